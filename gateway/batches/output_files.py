"""An OpenAI batch's output and error files, as OpenAI writes them.

One JSON line per item, in input order: ``{id, custom_id, response: {status_code,
request_id, body}, error}``.  An answered item goes to the output file; an item
answered with an error status to the error file (``response.body`` is the error
body the endpoint would have sent); an item never sent, its batch cancelled or
expired first, to the error file with ``response: null`` and ``error: {code,
message}`` (``batch_cancelled``, ``batch_expired``).  A file with no lines is not
made (its id stays null).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.batches.store import BatchRow, ItemRow

_NOT_SENT = {
    "canceled": (
        "batch_cancelled",
        "This request was not executed because the batch was cancelled.",
    ),
    "expired": (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
}


def _line(batch_id: str, item: ItemRow) -> dict[str, Any]:
    line_id = f"batch_req_{batch_id.removeprefix('batch_')}_{item.idx}"
    if item.state in _NOT_SENT:
        code, message = _NOT_SENT[item.state]
        return {
            "id": line_id,
            "custom_id": item.custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    result = item.result or {}
    if "error" in result:
        e = result["error"]
        body: Any = {"error": {k: e.get(k) for k in ("message", "type", "param", "code")}}
    else:
        body = result.get("body")
    line = {
        "id": line_id,
        "custom_id": item.custom_id,
        "response": {
            "status_code": item.status_code,
            "request_id": result.get("request_id"),
            "body": body,
        },
        "error": None,
    }
    if "cost" in result:  # vcache's own: the item's cost, billed and in arrival order
        line["vcache"] = {"cost": result["cost"]}
    return line


def _jsonl(lines: list[dict[str, Any]]) -> bytes | None:
    if not lines:
        return None
    return "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()


def output_files(batch: BatchRow, items: list[ItemRow]) -> tuple[bytes | None, bytes | None]:
    """The output and error files of a settled OpenAI batch (Anthropic's: none, its
    results are read from the items)."""
    if batch.api != "openai":
        return None, None
    done = [_line(batch.id, i) for i in items if i.state == "done"]
    failed = [_line(batch.id, i) for i in items if i.state != "done"]
    return _jsonl(done), _jsonl(failed)
