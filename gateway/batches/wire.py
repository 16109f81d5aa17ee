"""The batch APIs' objects on the wire: OpenAI's file and batch, Anthropic's message
batch, each built from the store's rows.

Output models allow extra fields, as the SDKs' do.  Both batch objects carry a
``vcache`` extension: the plan the prefix DAG measured of the items
(:func:`gateway.batches.plan.measures`) and the finished items' usage, cached tokens
included.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gateway.batches.cost import measured
from gateway.batches.store import BatchRow, FileRow


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class FileObject(_Out):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class RequestCounts(_Out):
    total: int
    completed: int
    failed: int


class InputTokensDetails(_Out):
    cached_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class BatchUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Extension(_Out):
    """vcache's own: the DAG's plan of the batch (with its predicted cost), the finished
    items' usage, and their cost as billed and in arrival order."""

    plan: dict[str, Any]
    usage: dict[str, int]
    cost: dict[str, Any]


class BatchObject(_Out):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: None = None
    input_file_id: str
    completion_window: str = "24h"
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None = None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None
    model: str
    vcache: Extension


class BatchList(_Out):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class MessageBatchCounts(_Out):
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatchObject(_Out):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchCounts
    ended_at: str | None
    created_at: str
    expires_at: str
    archived_at: str | None = None
    cancel_initiated_at: str | None
    results_url: str | None
    vcache: Extension


class MessageBatchList(_Out):
    data: list[MessageBatchObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedMessageBatch(_Out):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"


def file_object(f: FileRow) -> FileObject:
    return FileObject(
        id=f.id, bytes=f.bytes, created_at=int(f.created), filename=f.filename, purpose=f.purpose
    )


def _int(t: float | None) -> int | None:
    return None if t is None else int(t)


def _rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _extension(b: BatchRow) -> Extension:
    u = b.totals
    return Extension(
        plan=b.plan,
        usage={"input_tokens": u.input, "cached_tokens": u.cached, "output_tokens": u.output},
        cost=measured(u),
    )


def batch_object(b: BatchRow) -> BatchObject:
    c, u = b.counts, b.totals
    ended = _int(b.ended_at)
    return BatchObject(
        id=b.id,
        endpoint=b.endpoint,
        input_file_id=b.input_file_id or "",
        status=b.status,
        output_file_id=b.output_file_id,
        error_file_id=b.error_file_id,
        created_at=int(b.created),
        in_progress_at=_int(b.in_progress_at),
        expires_at=int(b.expires),
        finalizing_at=_int(b.finalizing_at),
        completed_at=ended if b.status == "completed" else None,
        expired_at=ended if b.status == "expired" else None,
        cancelling_at=_int(b.cancelling_at),
        cancelled_at=ended if b.status == "cancelled" else None,
        request_counts=RequestCounts(total=c.total, completed=c.done, failed=c.error + c.expired),
        usage=BatchUsage(
            input_tokens=u.input,
            input_tokens_details=InputTokensDetails(cached_tokens=u.cached),
            output_tokens=u.output,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=u.input + u.output,
        ),
        metadata=b.metadata,
        model=b.model,
        vcache=_extension(b),
    )


_PROCESSING: dict[str, Literal["in_progress", "canceling", "ended"]] = {
    "in_progress": "in_progress",
    "cancelling": "canceling",
}


def message_batch_object(b: BatchRow, results_url: str) -> MessageBatchObject:
    """``results_url``: where its results are read (given once the batch has ended)."""
    c = b.counts
    return MessageBatchObject(
        id=b.id,
        processing_status=_PROCESSING.get(b.status, "ended"),
        request_counts=MessageBatchCounts(
            processing=c.pending + c.running,
            succeeded=c.done,
            errored=c.error,
            canceled=c.canceled,
            expired=c.expired,
        ),
        ended_at=_rfc3339(b.ended_at),
        created_at=_rfc3339(b.created) or "",
        expires_at=_rfc3339(b.expires) or "",
        cancel_initiated_at=_rfc3339(b.cancelling_at),
        results_url=results_url if b.ended else None,
        vcache=_extension(b),
    )


class BatchPlan(_Out):
    """A dry run's answer: the plan of the batch the body would make (see
    :func:`gateway.batches.plan.preview`)."""

    object: Literal["batch.plan"] = "batch.plan"
    endpoint: str
    plan: dict[str, Any]
    order: list[dict[str, Any]]
    anchors: list[dict[str, Any]]
    providers: list[dict[str, Any]] = []  # per hosted target: online vs its batch API
