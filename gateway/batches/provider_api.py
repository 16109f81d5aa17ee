"""A batch sent to its hosted provider's own batch API, where the provider plan chose it.

:class:`BatchAPIClient` speaks both providers' batch APIs over the provider transport:
OpenAI's (a ``purpose: batch`` JSON lines file uploaded, ``POST /batches`` on it, the
batch polled until it ends, its output and error files read) and Anthropic's Message
Batches (``POST /messages/batches`` with the requests, polled, its ``results_url``
read).  Each item's line carries the exact bytes the gateway rendered for it (the
JSON body the online request would have sent), so what the provider receives is what
the session log recorded.

:class:`ProviderBatches` runs a vcache batch of chat completions that way: each item is
validated as the route would, planned and rendered for the target
(:meth:`ProviderChat.prepare`: the belief, the breakpoints, the byte-stable prefix) and
journaled (opened and recorded, verified when verification is on) before anything is
sent; the whole batch goes in one submission in the prefix DAG's order; each result is
mapped back by ``custom_id``, parsed by the provider's adapter, journaled as the
answer, settled into the belief (verify, then account) and shaped into the chat
completion the endpoint would have answered.  An item the provider answered with an
error is that item's error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engines.providers.base import Answer, Rendered
from engines.providers.transport import AiohttpTransport, Transport
from gateway.batches.send import CHAT, Outcome, error_of, usage_of
from gateway.core.errors import APIError, BadGateway, InvalidRequest, invalid_request_from
from gateway.core.pieces import Piece, ToolCallDelta
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.shaping import chat_completion
from gateway.core.target import Call
from gateway.core.types import Principal
from gateway.service.chat import GatewayService, chat_shape
from gateway.service.provider_chat import ProviderPrepared
from gateway.service.provider_chat import usage_of as provider_usage
from manifest.prefix_dag import Step, Unit

log = logging.getLogger(__name__)

SUPPORTED = ("openai", "anthropic")
TERMINAL = {"completed", "failed", "expired", "cancelled", "ended"}


@dataclass(frozen=True)
class Endpoint:
    """Where a target's batch API lives and how to authenticate to it."""

    provider: str
    base_url: str  # the provider's API root (…/v1)
    headers: Mapping[str, str]


class BatchAPIError(Exception):
    """The provider's batch API refused or failed the submission."""


class BatchAPIClient:
    def __init__(self, transport: Transport | None = None, poll_s: float = 30.0) -> None:
        """``transport``: how requests reach the providers (None: an aiohttp session of its
        own, closed by :meth:`aclose`); ``poll_s``: between two reads of a running batch."""
        self._own = transport is None
        self._transport: Transport = transport or AiohttpTransport()
        self._poll_s = poll_s

    async def aclose(self) -> None:
        if self._own:
            await self._transport.aclose()

    async def _call(
        self, e: Endpoint, method: str, url: str, body: bytes | None = None, ctype: str = ""
    ) -> tuple[int, bytes]:
        headers = dict(e.headers)
        if ctype:
            headers["content-type"] = ctype
        full = url if url.startswith("http") else e.base_url.rstrip("/") + url
        async with self._transport.request(method, full, headers, body) as r:
            return r.status, await r.read()

    async def _json(
        self, e: Endpoint, method: str, url: str, body: bytes | None = None, ctype: str = ""
    ) -> Any:
        status, data = await self._call(e, method, url, body, ctype)
        if status >= 400:
            raise BatchAPIError(f"{e.provider} {method} {url}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    async def run(self, e: Endpoint, items: Sequence[tuple[str, Rendered]]) -> dict[str, Any]:
        """Submit ``items`` (custom_id, rendered request) as one batch, wait for its end;
        custom_id → (status code, body) for every item answered."""
        if e.provider == "openai":
            return await self._openai(e, items)
        if e.provider == "anthropic":
            return await self._anthropic(e, items)
        raise BatchAPIError(f"{e.provider} has no batch API here")

    async def _wait(self, e: Endpoint, url: str, status_key: str) -> Any:
        while True:
            row = await self._json(e, "GET", url)
            if row.get(status_key) in TERMINAL:
                return row
            await asyncio.sleep(self._poll_s)

    async def _openai(self, e: Endpoint, items: Sequence[tuple[str, Rendered]]) -> dict[str, Any]:
        lines = b"".join(
            b'{"custom_id":'
            + json.dumps(cid).encode()
            + b',"method":"POST","url":'
            + json.dumps("/v1" + r.path).encode()
            + b',"body":'
            + r.body
            + b"}\n"
            for cid, r in items
        )
        boundary = f"vcache-{uuid.uuid4().hex}"
        form = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="batch.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
            ).encode()
            + lines
            + f"\r\n--{boundary}--\r\n".encode()
        )
        f = await self._json(e, "POST", "/files", form, f"multipart/form-data; boundary={boundary}")
        endpoint = "/v1" + items[0][1].path
        spec = {"input_file_id": f["id"], "endpoint": endpoint, "completion_window": "24h"}
        b = await self._json(e, "POST", "/batches", json.dumps(spec).encode(), "application/json")
        row = await self._wait(e, f"/batches/{b['id']}", "status")
        if row["status"] == "failed":
            raise BatchAPIError(f"openai batch {b['id']} failed: {row.get('errors')}")
        out: dict[str, Any] = {}
        for key in ("output_file_id", "error_file_id"):
            if row.get(key):
                status, data = await self._call(e, "GET", f"/files/{row[key]}/content")
                if status >= 400:
                    raise BatchAPIError(f"openai file {row[key]}: HTTP {status}")
                for ln in data.splitlines():
                    if ln.strip():
                        x = json.loads(ln)
                        resp = x.get("response")
                        if resp is not None:
                            out[x["custom_id"]] = (int(resp["status_code"]), resp["body"])
        return out

    async def _anthropic(
        self, e: Endpoint, items: Sequence[tuple[str, Rendered]]
    ) -> dict[str, Any]:
        reqs = b",".join(
            b'{"custom_id":' + json.dumps(cid).encode() + b',"params":' + r.body + b"}"
            for cid, r in items
        )
        body = b'{"requests":[' + reqs + b"]}"
        b = await self._json(e, "POST", "/messages/batches", body, "application/json")
        row = await self._wait(e, f"/messages/batches/{b['id']}", "processing_status")
        status, data = await self._call(e, "GET", str(row["results_url"]))
        if status >= 400:
            raise BatchAPIError(f"anthropic results of {b['id']}: HTTP {status}")
        out: dict[str, Any] = {}
        for ln in data.splitlines():
            if not ln.strip():
                continue
            x = json.loads(ln)
            result = x["result"]
            if result["type"] == "succeeded":
                out[x["custom_id"]] = (200, result["message"])
            elif result["type"] == "errored":
                err = result.get("error") or {}
                kind = (err.get("error") or {}).get("type")
                out[x["custom_id"]] = (500 if kind == "api_error" else 400, err)
        return out


async def _pieces(a: Answer, usage: Any) -> AsyncGenerator[Piece, None]:
    parts = tuple(ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(a.tool_calls))
    yield Piece(
        a.text,
        a.finish_reason,
        tool_calls=parts,
        thinking=a.thinking,
        stop_sequence=a.stop_sequence,
    )
    yield Piece(usage=usage)


@dataclass(frozen=True)
class _Item:
    idx: int
    req: ChatCompletionRequest
    prepared: ProviderPrepared
    op: Any  # the session log's Open (None without a log)


class ProviderBatches:
    """Chat-completion items through their provider's batch API (see the module)."""

    def __init__(
        self,
        svc: GatewayService,
        client: BatchAPIClient,
        endpoint_of: Callable[[str], Endpoint | None],
        choose: Callable[[str, Sequence[Unit], Sequence[Step]], str | None],
    ) -> None:
        """``endpoint_of(target name)``: the target's :class:`Endpoint` (None: not one
        whose batch API is served); ``choose(model, units, steps)``: the target whose
        batch API the provider plan chooses (None: online)."""
        self._svc = svc
        self._client = client
        self._endpoint_of = endpoint_of
        self._choose = choose

    def choose(
        self, endpoint: str, model: str | None, units: Sequence[Unit], steps: Sequence[Step]
    ) -> str | None:
        """The hosted target to send a batch to through its own batch API (chat
        completions only), or None: the items go online."""
        if endpoint != CHAT or model is None:
            return None
        return self._choose(model, units, steps)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def run(
        self, target: str, items: Sequence[tuple[int, dict[str, Any]]], who: Principal
    ) -> dict[int, Outcome]:
        """Every item's outcome (an item refused before the submission is its own error;
        a submission that fails is every submitted item's 502)."""
        svc, chat = self._svc, self._svc.providers
        endpoint = self._endpoint_of(target)
        if chat is None or endpoint is None:
            raise ValueError(f"{target} has no batch API here")
        journal = svc.loop.journal
        out: dict[int, Outcome] = {}
        ready: list[_Item] = []
        for idx, body in items:
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            try:
                req = svc.named(ChatCompletionRequest.model_validate({**body, "stream": False}))
                if req.model != target and target not in svc.resolve(req.model):
                    raise InvalidRequest(f"'{req.model}' is not served by {target}", param="model")
                call = Call(req, who, rid)
                p = await chat.prepare(target, call)
                op = journal.open(who.tenant, p.header, p.turns, None)
                s = p.sent
                await journal.sent(op, s.request_id, s.target, s.render, s.directives, s.body)
            except ValidationError as exc:
                err = invalid_request_from(exc.errors())
                out[idx] = Outcome(err.status, rid, error=error_of(err))
                continue
            except APIError as exc:
                out[idx] = Outcome(exc.status, rid, error=error_of(exc))
                continue
            ready.append(_Item(idx, req, p, op))
        if not ready:
            return out
        lines = [(f"i{it.idx}", it.prepared.planned.rendered) for it in ready]
        try:
            results = await self._client.run(endpoint, lines)
        except BatchAPIError as exc:
            log.warning("batch to %s's batch API failed: %s", target, exc)
            bad = BadGateway(f"the provider's batch API failed: {exc}")
            for it in ready:
                out[it.idx] = Outcome(502, it.prepared.request_id, error=error_of(bad))
            return out
        for it in ready:
            out[it.idx] = await self._answered(it, results.get(f"i{it.idx}"), journal)
        return out

    async def _answered(self, it: _Item, result: Any, journal: Any) -> Outcome:
        p, rid = it.prepared, it.prepared.request_id
        if result is None:
            bad = BadGateway("the provider's batch did not answer this item")
            return Outcome(502, rid, error=error_of(bad))
        status, body = result
        if status != 200:
            kind = "invalid_request_error" if status < 500 else "server_error"
            message = f"the provider answered {status}: {json.dumps(body)[:500]}"
            err = {"status": status, "type": kind, "code": None, "param": None, "message": message}
            return Outcome(status, rid, error=err)
        adapter = p.planned.target.client.adapter
        answer = adapter.parse(body)
        usage = provider_usage(answer.usage)
        shaped = await chat_completion(
            rid, it.req.model, _pieces(answer, usage), chat_shape(it.req)
        )
        await journal.answered(it.op, rid, answer.text, usage)
        self._svc.providers.settle(p, usage)  # type: ignore[union-attr]
        out = shaped.model_dump(mode="json")
        return Outcome(200, rid, body=out, usage=usage_of(out))
