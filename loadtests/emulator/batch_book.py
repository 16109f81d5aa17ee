"""What the emulator keeps of the providers' batch APIs: uploaded files, batch jobs and
the rules a batch runs under (how long it takes, how many items run side by side).

Plain data: :mod:`.batch_jobs` runs the jobs, :mod:`.openai_batches` and
:mod:`.anthropic_batches` serve them in each provider's wire format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BATCH_DISCOUNT = 0.5  # both providers bill a batch's tokens at half the online price


@dataclass
class BatchRules:
    """``delay_s``: emulator seconds from a batch's creation until it has run (its items
    are answered on the first read after that); ``parallel``: items answered side by side
    in one wave, which do not read each other's cache writes (caching inside a batch is
    best effort: only a later wave reads an earlier wave's prefixes); ``wave_s``: emulator
    seconds each wave takes (the clock moves on while a long batch runs, so a prefix
    written early may expire before an item late in the batch reads it)."""

    delay_s: float = 1.0
    parallel: int = 16
    wave_s: float = 0.0


@dataclass
class StoredFile:
    id: str
    purpose: str  # batch (an input file), batch_output
    filename: str
    data: bytes
    created_at: int


@dataclass
class Item:
    custom_id: str
    body: Any  # the request's params as received (checked when the item runs)
    status: int | None = None  # None: not run
    answer: dict[str, Any] | None = None  # the response body, or the error body


@dataclass
class Job:
    id: str
    provider: str  # openai, anthropic
    endpoint: str  # /v1/chat/completions, /v1/responses, /v1/messages
    items: list[Item]
    created: float  # on the emulator's clock
    created_at: int  # wall time, for the wire
    input_file_id: str | None = None
    metadata: dict[str, str] | None = None
    state: str = "in_progress"  # in_progress, cancelling, completed, cancelled, failed
    errors: list[dict[str, Any]] = field(default_factory=list)  # why it failed (OpenAI's)
    ended_at: int | None = None
    cancel_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None

    @property
    def ended(self) -> bool:
        return self.state in ("completed", "cancelled", "failed")


@dataclass
class BatchBook:
    rules: BatchRules = field(default_factory=BatchRules)
    files: dict[str, StoredFile] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)

    def clear(self) -> None:
        self.files.clear()
        self.jobs.clear()
        self.rules = BatchRules()
