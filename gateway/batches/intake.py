"""What a batch API takes in, checked against the API's own limits, and the batch it
makes.

OpenAI: a ``purpose: batch`` file is JSON lines ``{custom_id, method: "POST", url,
body}``, ``url`` one of :data:`~gateway.batches.send.OPENAI_ENDPOINTS`, ``custom_id``
unique in the file, at most 50,000 lines; a bad line is a 400 naming it (``line
3: ...``).  A batch names the file, an ``endpoint`` every line's ``url`` matches, the
``24h`` completion window and at most 16 metadata pairs (keys up to 64 characters,
values up to 512).  Anthropic: ``requests`` of 1 to 100,000 ``{custom_id, params}``,
``custom_id`` 1-64 letters, digits, ``-`` or ``_`` and unique, ``params`` an object
(validated as a Messages request when the item runs: a bad one is that item's
``errored`` result, as Anthropic does).

A new batch carries its plan: the prefix DAG's measures of its items
(:func:`gateway.batches.plan.measures`), visible before anything runs.  A create body
with ``"vcache": {"dry_run": true}`` is checked the same way but makes nothing: its
plan (:func:`gateway.batches.plan.preview`: order, anchors, predicted cost, the
provider plan of each hosted target the model resolves to) is the answer
(:func:`openai_plan`, :func:`anthropic_plan`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.batches.plan import measures, preview, units
from gateway.batches.provider_plan import ProviderOption
from gateway.batches.send import MESSAGES, OPENAI_ENDPOINTS
from gateway.batches.store import BatchRow, BatchStore, NewItem
from gateway.core.errors import InvalidRequest, NotFound
from gateway.core.types import Principal
from manifest.prefix_dag import PrefixDag

WINDOW_S = 24 * 3600.0
OPENAI_MAX_REQUESTS = 50_000
ANTHROPIC_MAX_REQUESTS = 100_000
_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class InputLine:
    custom_id: str
    url: str
    body: dict[str, Any]


def _bad(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_value")


def input_lines(data: bytes) -> list[InputLine]:
    """The lines of a ``purpose: batch`` file (see the module), or a 400 naming the
    first bad one."""
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise _bad(f"the file is not UTF-8 text (byte {exc.start})", "file") from exc
    out: list[InputLine] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"line {n}"
        try:
            line = json.loads(raw)
        except ValueError as exc:
            raise _bad(f"{where} is not valid JSON: {exc}", "file") from exc
        if not isinstance(line, dict):
            raise _bad(f"{where} must be a JSON object", "file")
        cid, method, url, body = (line.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(cid, str) or not cid:
            raise _bad(f"{where}: 'custom_id' must be a non-empty string", "file")
        if cid in seen:
            raise _bad(f"{where}: custom_id {cid!r} appears twice in the file", "file")
        if method != "POST":
            raise _bad(f"{where}: 'method' must be 'POST'", "file")
        if url not in OPENAI_ENDPOINTS:
            raise _bad(f"{where}: 'url' must be one of {', '.join(OPENAI_ENDPOINTS)}", "file")
        if not isinstance(body, dict):
            raise _bad(f"{where}: 'body' must be a JSON object", "file")
        seen.add(cid)
        out.append(InputLine(cid, url, body))
    if not out:
        raise _bad("the file has no requests", "file")
    if len(out) > OPENAI_MAX_REQUESTS:
        raise _bad(
            f"the file has {len(out)} requests; a batch takes at most {OPENAI_MAX_REQUESTS}", "file"
        )
    return out


def _metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise _bad("'metadata' must be an object of at most 16 pairs", "metadata")
    for k, v in metadata.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise _bad(
                f"metadata[{k[:64]!r}]: keys are up to 64 characters, values strings of up to 512",
                "metadata",
            )
    return dict(metadata)


def _plan(endpoint: str, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    us = units(endpoint, bodies)
    return measures(PrefixDag(us), us)


def dry_run(body: dict[str, Any]) -> bool:
    """Whether a create body asks for the plan only: ``"vcache": {"dry_run": true}``."""
    ext = body.get("vcache")
    if ext is None:
        return False
    if not isinstance(ext, dict) or set(ext) - {"dry_run"}:
        raise _bad("'vcache' must be an object with at most 'dry_run' (a boolean)", "vcache")
    flag = ext.get("dry_run", False)
    if not isinstance(flag, bool):
        raise _bad("'vcache.dry_run' must be a boolean", "vcache.dry_run")
    return flag


Options = Callable[[str], list[ProviderOption]]  # a model's hosted targets


def _options(bodies: list[dict[str, Any]], options: Options | None) -> list[ProviderOption]:
    """The hosted targets of the batch's model (its first item's: a batch has one)."""
    model = bodies[0].get("model") if bodies else None
    return options(model) if options is not None and isinstance(model, str) else []


def openai_plan(
    store: BatchStore, who: Principal, body: dict[str, Any], options: Options | None = None
) -> dict[str, Any]:
    """The plan of the batch a ``POST /v1/batches`` body would make, made of nothing;
    with ``options``, the provider plan of each hosted target its model resolves to."""
    endpoint, lines, _, _ = _openai_lines(store, who, body)
    bodies = [ln.body for ln in lines]
    return preview(endpoint, [ln.custom_id for ln in lines], bodies, _options(bodies, options))


def anthropic_plan(body: dict[str, Any], options: Options | None = None) -> dict[str, Any]:
    """The plan of the batch a ``POST /v1/messages/batches`` body would make."""
    bodies, items = _anthropic_items(body)
    return preview(MESSAGES, [i.custom_id for i in items], bodies, _options(bodies, options))


def openai_batch(store: BatchStore, who: Principal, body: dict[str, Any]) -> BatchRow:
    """A batch over the tenant's input file (the ``POST /v1/batches`` body)."""
    endpoint, lines, metadata, file_id = _openai_lines(store, who, body)
    bodies = [line.body for line in lines]
    return store.create(
        "openai",
        who.tenant,
        who.key_name,
        endpoint,
        str(bodies[0].get("model") or ""),
        [NewItem(line.custom_id, json.dumps(line.body)) for line in lines],
        window_s=WINDOW_S,
        metadata=metadata,
        plan=_plan(endpoint, bodies),
        input_file_id=file_id,
    )


def _openai_lines(
    store: BatchStore, who: Principal, body: dict[str, Any]
) -> tuple[str, list[InputLine], dict[str, str] | None, str]:
    """A ``POST /v1/batches`` body checked: its endpoint, input lines, metadata, file."""
    endpoint, window, file_id = (
        body.get(k) for k in ("endpoint", "completion_window", "input_file_id")
    )
    if not isinstance(file_id, str):
        raise _bad("'input_file_id' is required", "input_file_id")
    if endpoint not in OPENAI_ENDPOINTS:
        raise _bad(
            f"'endpoint' must be one of {', '.join(OPENAI_ENDPOINTS)} (got {endpoint!r})",
            "endpoint",
        )
    if window != "24h":
        raise _bad("'completion_window' must be '24h'", "completion_window")
    metadata = _metadata(body.get("metadata"))
    found = store.file(who.tenant, file_id)
    data = store.file_content(who.tenant, file_id)
    if found is None or data is None:
        raise NotFound(f"No such File object: {file_id}", param="input_file_id")
    if found.purpose != "batch":
        raise _bad(f"file {file_id} has purpose {found.purpose!r}, not 'batch'", "input_file_id")
    lines = input_lines(data)
    for n, line in enumerate(lines, start=1):
        if line.url != endpoint:
            raise _bad(
                f"request {n} ({line.custom_id!r}) is for {line.url}, the batch's endpoint is "
                f"{endpoint}",
                "input_file_id",
            )
    return str(endpoint), lines, metadata, file_id


def anthropic_batch(store: BatchStore, who: Principal, body: dict[str, Any]) -> BatchRow:
    """A batch of the ``POST /v1/messages/batches`` body's ``requests``."""
    bodies, items = _anthropic_items(body)
    return store.create(
        "anthropic",
        who.tenant,
        who.key_name,
        MESSAGES,
        str(bodies[0].get("model") or ""),
        items,
        window_s=WINDOW_S,
        plan=_plan(MESSAGES, bodies),
    )


def _anthropic_items(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[NewItem]]:
    """A ``POST /v1/messages/batches`` body checked: its items' params and rows."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise _bad("requests: must be a non-empty list", "requests")
    if len(requests) > ANTHROPIC_MAX_REQUESTS:
        raise _bad(
            f"requests: {len(requests)} requests; a batch takes at most {ANTHROPIC_MAX_REQUESTS}",
            "requests",
        )
    seen: set[str] = set()
    bodies: list[dict[str, Any]] = []
    items: list[NewItem] = []
    for i, r in enumerate(requests):
        where = f"requests.{i}"
        if not isinstance(r, dict):
            raise _bad(f"{where}: must be an object", where)
        cid, params = r.get("custom_id"), r.get("params")
        if not isinstance(cid, str) or not _CUSTOM_ID.match(cid):
            raise _bad(
                f"{where}.custom_id: 1-64 letters, digits, '-' or '_' (got {cid!r})",
                f"{where}.custom_id",
            )
        if cid in seen:
            raise _bad(
                f"{where}.custom_id: {cid!r} is used twice in the batch", f"{where}.custom_id"
            )
        if not isinstance(params, dict):
            raise _bad(f"{where}.params: must be an object", f"{where}.params")
        seen.add(cid)
        bodies.append(params)
        items.append(NewItem(cid, json.dumps(params)))
    return bodies, items
