"""A batch sent to its hosted provider's own batch API, where the provider plan chose it.

:class:`BatchAPIClient` speaks both providers' batch APIs over the provider transport:
OpenAI's (a ``purpose: batch`` JSON lines file uploaded, ``POST /batches`` on it, the
batch polled until it ends, its output and error files read) and Anthropic's Message
Batches (``POST /messages/batches`` with the requests, polled, its ``results_url``
read).  Each item's line carries the exact bytes the gateway rendered for it (the
JSON body the online request would have sent), so what the provider receives is what
the session log recorded.

:class:`ProviderBatches` runs a vcache batch of chat completions that way (Messages and
Responses items as the chat requests they map to): each item is validated as the route
would, planned and rendered for the target
(:meth:`ProviderChat.prepare`: the belief, the breakpoints, the byte-stable prefix) and
journaled (opened and recorded, verified when verification is on) before anything is
sent; the whole batch goes in one submission in the prefix DAG's order; each result is
mapped back by ``custom_id``, parsed by the provider's adapter, journaled as the
answer, settled into the belief (verify, then account) and shaped into the chat
completion, Message or Response the endpoint would have answered.  An item the provider
answered with an error is that item's error.  A submission is kept in the store before
its create (:meth:`ProviderBatches.ticket`), so a gateway stopped before the create's
answer was written finds the batch it made after the restart
(:meth:`ProviderBatches.made`) rather than make a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from engines.providers.base import Answer, Rendered
from engines.providers.transport import AiohttpTransport, Transport, TransportError
from gateway.batches.provider_plan import Choice, Sample
from gateway.batches.send import CHAT, MESSAGES, RESPONSES, Outcome, error_of, usage_of
from gateway.core.errors import APIError, BadGateway, InvalidRequest, invalid_request_from
from gateway.core.messages_wire import MessagesRequest
from gateway.core.pieces import Piece, ToolCallDelta
from gateway.core.responses_wire import ResponsesRequest
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.shaping import chat_completion
from gateway.core.target import Call
from gateway.core.types import Principal
from gateway.service.chat import GatewayService, chat_shape
from gateway.service.message_answers import whole_message
from gateway.service.messages_api import mapped, message_id
from gateway.service.provider_chat import ProviderPrepared
from gateway.service.provider_chat import usage_of as provider_usage
from gateway.service.response_tools import ResponseTools, response_tools
from gateway.service.responses_api import chat_request, response_of
from manifest.prefix_dag import Step, Unit

log = logging.getLogger(__name__)

SUPPORTED = ("openai", "anthropic")
TERMINAL = {"completed", "failed", "expired", "cancelled", "ended"}
SUBMIT_ATTEMPTS = 5  # tries of each call that makes a submission, then its items fail
SUBMIT_BACKOFF_S = 1.0  # before the second try, doubling, at most SUBMIT_BACKOFF_CAP_S
SUBMIT_BACKOFF_CAP_S = 30.0
SUBMIT_FAILED = "provider_batch_submit_failed"  # the items' error code when it never took

# an item's result from a provider's batch: (status code, body), or never run
Result = tuple[int, Any] | Literal["canceled", "expired"]


@dataclass(frozen=True)
class Endpoint:
    """Where a target's batch API lives and how to authenticate to it."""

    provider: str
    base_url: str  # the provider's API root (…/v1)
    headers: Mapping[str, str]


@dataclass(frozen=True)
class Finished:
    """A provider's batch that has ended: its status there, custom_id → result, and what
    an item the results leave out is (``rest``; None: an item the provider lost)."""

    status: str
    results: dict[str, Result]
    rest: Result | None = None

    def of(self, custom_id: str) -> Result | None:
        return self.results.get(custom_id, self.rest)


class BatchAPIError(Exception):
    """The provider's batch API refused or failed the submission (``transient``: a 429,
    a 5xx or no answer, worth another try)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class BatchAPIClient:
    def __init__(
        self,
        transport: Transport | None = None,
        poll_s: float = 30.0,
        *,
        attempts: int = SUBMIT_ATTEMPTS,
        backoff_s: float = SUBMIT_BACKOFF_S,
        call_timeout_s: float = 120.0,
    ) -> None:
        """``transport``: how requests reach the providers (None: an aiohttp session of its
        own, closed by :meth:`aclose`); ``poll_s``: between two reads of a running batch;
        ``attempts``, ``backoff_s``: how often and how far apart a call that makes a
        submission is tried (a 429, 5xx or timeout); ``call_timeout_s``: one call's bound."""
        self._own = transport is None
        self._transport: Transport = transport or AiohttpTransport()
        self._poll_s = poll_s
        self._attempts = max(1, attempts)
        self._backoff_s = backoff_s
        self._call_timeout_s = call_timeout_s

    async def aclose(self) -> None:
        if self._own:
            await self._transport.aclose()

    async def _call(
        self, e: Endpoint, method: str, url: str, body: bytes | None = None, ctype: str = ""
    ) -> tuple[int, bytes]:
        """Status and body; :class:`BatchAPIError` (transient) when no answer came."""
        headers = dict(e.headers)
        if ctype:
            headers["content-type"] = ctype
        full = url if url.startswith("http") else e.base_url.rstrip("/") + url
        try:
            async with asyncio.timeout(self._call_timeout_s):
                async with self._transport.request(method, full, headers, body) as r:
                    data = await r.read()
                    return r.status, data
        except (TransportError, TimeoutError) as exc:
            raise BatchAPIError(f"{e.provider} {method} {url}: no answer ({exc!r})", True) from exc

    async def _json(
        self, e: Endpoint, method: str, url: str, body: bytes | None = None, ctype: str = ""
    ) -> Any:
        status, data = await self._call(e, method, url, body, ctype)
        if status >= 400:
            raise BatchAPIError(
                f"{e.provider} {method} {url}: HTTP {status}: {data[:300]!r}",
                status == 429 or status >= 500,
            )
        return json.loads(data)

    async def _tried(
        self,
        e: Endpoint,
        what: str,
        call: Callable[[], Awaitable[Any]],
        made: Callable[[], Awaitable[Any]] | None = None,
    ) -> Any:
        """``call()``, tried again after a transient failure (backoff doubling from
        ``backoff_s``), at most ``attempts`` times; before another try, ``made()`` looks
        for what a call whose answer was lost may have made (not None: that, no retry).
        :class:`BatchAPIError` naming the last failure when every try failed."""
        for attempt in range(self._attempts):
            try:
                return await call()
            except BatchAPIError as exc:
                if not exc.transient or attempt + 1 == self._attempts:
                    raise BatchAPIError(f"{what} failed after {attempt + 1} tries: {exc}") from exc
                log.warning("%s: try %d failed (%s), trying again", what, attempt + 1, exc)
                await asyncio.sleep(min(SUBMIT_BACKOFF_CAP_S, self._backoff_s * 2.0**attempt))
                if made is not None:
                    found = await made()
                    if found is not None:
                        return found
        raise AssertionError("unreachable")

    async def lookup(self, e: Endpoint) -> dict[str, Any]:
        """What finds a submission besides its token, read before it is made (and kept
        with it): OpenAI's batches carry the token as metadata, nothing more; Anthropic's
        Message Batches carry none, so the ids of the newest batches already there
        (``before``): the one new batch of the submission's size is it."""
        if e.provider == "anthropic":
            return {"before": sorted(str(b["id"]) for b in await self._anthropic_page(e))}
        return {}

    async def submit(
        self,
        e: Endpoint,
        items: Sequence[tuple[str, Rendered]],
        token: str,
        lookup: Mapping[str, Any] | None = None,
    ) -> str:
        """Submit ``items`` (custom_id, rendered request) as one batch: its id at the
        provider.  ``token`` and ``lookup`` (:meth:`lookup`; read now when None) name the
        submission: a create whose answer was lost is looked for by them before it is
        tried again, so a batch is never made twice."""
        if e.provider == "openai":
            return await self._openai_submit(e, items, token)
        if e.provider == "anthropic":
            found = lookup if lookup is not None else await self.lookup(e)
            return await self._anthropic_submit(e, items, set(found.get("before") or ()))
        raise BatchAPIError(f"{e.provider} has no batch API here")

    async def made(self, e: Endpoint, token: str, lookup: Mapping[str, Any], n: int) -> str | None:
        """The id of the batch a submission of ``n`` items named ``token`` (and
        ``lookup``) made, if the provider has it (None: it was never made).  OpenAI: the
        batch whose metadata carries the token; Anthropic: the one batch of ``n`` requests
        not among ``before`` (weaker: another client's batch of that size made since is
        taken for it, and two such make it None).  :class:`BatchAPIError` when the
        provider's list cannot be read."""
        if e.provider == "openai":
            b = await self._openai_made(e, token)
        elif e.provider == "anthropic":
            b = await self._anthropic_made(e, set(lookup.get("before") or ()), n)
        else:
            raise BatchAPIError(f"{e.provider} has no batch API here")
        return None if b is None else str(b["id"])

    async def wait(
        self, e: Endpoint, run_id: str, cancelled: Callable[[], Awaitable[bool]]
    ) -> Finished:
        """Poll the provider's batch until it ends, then its results.  Once
        ``cancelled()`` is true the provider's batch is cancelled (once); the results
        then hold what it finished before it stopped, the rest canceled.  A poll
        that fails for a while (429, 5xx, no answer) is tried again at the next poll;
        a refusal (another 4xx: the batch is gone) is :class:`BatchAPIError`."""
        url = f"/batches/{run_id}" if e.provider == "openai" else f"/messages/batches/{run_id}"
        key = "status" if e.provider == "openai" else "processing_status"
        asked = False
        while True:
            try:
                row = await self._json(e, "GET", url)
            except BatchAPIError as exc:
                if not exc.transient:
                    raise
                log.warning("polling %s's batch %s failed (%s)", e.provider, run_id, exc)
                row = {}
            if row.get(key) in TERMINAL:
                break
            if not asked and await cancelled():
                try:
                    await self._tried(
                        e, f"cancelling {run_id}", lambda: self._json(e, "POST", url + "/cancel")
                    )
                except BatchAPIError as exc:  # it ended first (409), or the provider is down:
                    log.warning("%s", exc)  # its results are read as they are
                asked = True
                continue
            await asyncio.sleep(self._poll_s)
        if e.provider == "openai":
            results = await self._openai_results(e, row)
        else:
            results = await self._anthropic_results(e, row)
        status = str(row[key])
        rest: Result | None = None  # an item the results leave out: not answered
        if status in ("cancelled", "expired") or asked:
            rest = "expired" if status == "expired" else "canceled"
        return Finished(status, results, rest)

    async def _openai_submit(
        self, e: Endpoint, items: Sequence[tuple[str, Rendered]], token: str
    ) -> str:
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
        ctype = f"multipart/form-data; boundary={boundary}"
        f = await self._tried(
            e, "uploading the batch file", lambda: self._json(e, "POST", "/files", form, ctype)
        )
        endpoint = "/v1" + items[0][1].path
        spec = {
            "input_file_id": f["id"],
            "endpoint": endpoint,
            "completion_window": "24h",
            "metadata": {"vcache_submission": token},
        }
        body = json.dumps(spec).encode()

        async def made() -> Any:
            return await self._openai_made(e, token)

        b = await self._tried(
            e,
            "creating the batch",
            lambda: self._json(e, "POST", "/batches", body, "application/json"),
            made,
        )
        return str(b["id"])

    async def _openai_made(self, e: Endpoint, token: str) -> Any:
        """The batch a failed create made, found by its token among the newest (None:
        none; a list that cannot be read ends the tries rather than risk a second batch)."""
        page = await self._tried(
            e, "listing batches", lambda: self._json(e, "GET", "/batches?limit=100")
        )
        for b in page.get("data") or []:
            if (b.get("metadata") or {}).get("vcache_submission") == token:
                return b
        return None

    async def _openai_results(self, e: Endpoint, row: Any) -> dict[str, Result]:
        if row["status"] == "failed":
            raise BatchAPIError(f"openai batch {row['id']} failed: {row.get('errors')}")
        out: dict[str, Result] = {}
        for key in ("output_file_id", "error_file_id"):
            if not row.get(key):
                continue
            url = f"/files/{row[key]}/content"
            data = await self._tried(e, f"reading {url}", functools.partial(self._bytes, e, url))
            for ln in data.splitlines():
                if not ln.strip():
                    continue
                x = json.loads(ln)
                resp = x.get("response")
                if resp is not None:
                    out[x["custom_id"]] = (int(resp["status_code"]), resp["body"])
                else:
                    code = (x.get("error") or {}).get("code")
                    out[x["custom_id"]] = "expired" if code == "batch_expired" else "canceled"
        return out

    async def _bytes(self, e: Endpoint, url: str) -> bytes:
        status, data = await self._call(e, "GET", url)
        if status >= 400:
            raise BatchAPIError(
                f"{e.provider} GET {url}: HTTP {status}", status == 429 or status >= 500
            )
        return data

    async def _anthropic_submit(
        self, e: Endpoint, items: Sequence[tuple[str, Rendered]], before: set[str]
    ) -> str:
        reqs = b",".join(
            b'{"custom_id":' + json.dumps(cid).encode() + b',"params":' + r.body + b"}"
            for cid, r in items
        )
        body = b'{"requests":[' + reqs + b"]}"
        ids = {cid for cid, _ in items}

        async def made() -> Any:
            return await self._anthropic_made(e, before, len(ids))

        b = await self._tried(
            e,
            "creating the message batch",
            lambda: self._json(e, "POST", "/messages/batches", body, "application/json"),
            made,
        )
        return str(b["id"])

    async def _anthropic_page(self, e: Endpoint) -> list[Any]:
        """The newest message batches (tried as a submission's calls are; one that cannot
        be read ends the submission's tries rather than risk a second batch)."""
        page = await self._tried(
            e,
            "listing message batches",
            lambda: self._json(e, "GET", "/messages/batches?limit=100"),
        )
        return list(page.get("data") or [])

    async def _anthropic_made(self, e: Endpoint, before: set[str], n: int) -> Any:
        """The batch a lost create made: Message Batches carry no metadata, so the one
        batch of ``n`` requests that was not there before the first try (None: none, or
        not exactly one)."""
        new = [
            b
            for b in await self._anthropic_page(e)
            if str(b["id"]) not in before
            and sum(int(v) for v in (b.get("request_counts") or {}).values()) == n
        ]
        return new[0] if len(new) == 1 else None

    async def _anthropic_results(self, e: Endpoint, row: Any) -> dict[str, Result]:
        url = str(row["results_url"])
        data = await self._tried(e, f"reading {url}", lambda: self._bytes(e, url))
        out: dict[str, Result] = {}
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
            elif result["type"] in ("canceled", "expired"):
                out[x["custom_id"]] = result["type"]
        return out


def _long_tier(p: ProviderPrepared) -> ProviderPrepared:
    """``p`` with every breakpoint the planner placed at the long TTL (rendered again; the
    log records these directives, so it rebuilds to these bytes)."""
    planned = p.planned
    if not planned.marked or planned.placed_by == "client":
        return p
    directives = dataclasses.replace(planned.directives, long_ttl=planned.marked)
    rendered = planned.target.client.adapter.render(planned.call, directives)
    long = dataclasses.replace(planned, directives=directives, rendered=rendered)
    return dataclasses.replace(p, planned=long)


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
    request_id: str
    resumed: bool = False  # planned again after a restart: sent before it, not settled
    endpoint: str = CHAT  # the vcache batch's: its answer is shaped as that API's
    model: str = ""  # as the client named it (a Messages answer's ``model``)
    asked: tuple[ResponsesRequest, ResponseTools] | None = None  # a Responses item's


Settled = Outcome | Literal["canceled", "expired"]


@dataclass(frozen=True)
class Ticket:
    """A submission's names before it is made: ``token`` (sent with it where the provider
    keeps metadata) and ``lookup`` (what else finds it, see :meth:`BatchAPIClient.lookup`)."""

    token: str
    lookup: Mapping[str, Any]


@dataclass(frozen=True)
class Submission:
    """A vcache batch's items for one submission to ``target``'s batch API: those ready
    (planned, rendered, journaled) and those refused before anything was sent."""

    target: str
    items: list[_Item]
    refused: dict[int, Outcome]

    def journal(self) -> dict[int, dict[str, str | None]]:
        """What the store keeps per item: the request id and session the log recorded
        the request sent under (a restart journals the answer there)."""
        return {
            it.idx: {
                "request_id": it.request_id,
                "session_id": getattr(it.op, "session_id", None),
            }
            for it in self.items
        }


class ProviderBatches:
    """Chat-completion items through their provider's batch API (see the module)."""

    def __init__(
        self,
        svc: GatewayService,
        client: BatchAPIClient,
        endpoint_of: Callable[[str], Endpoint | None],
        choose: Callable[[str, Sequence[Unit], Sequence[Step]], Choice | None],
        learn: Callable[[str, str, Iterable[Sample]], object] | None = None,
    ) -> None:
        """``endpoint_of(target name)``: the target's :class:`Endpoint` (None: not one
        whose batch API is served); ``choose(model, units, steps)``: the target whose
        batch API the provider plan chooses, with its TTL (None: online); ``learn(target,
        kind, samples)``: a finished batch's measured hit share, to the plan."""
        self._svc = svc
        self._client = client
        self._endpoint_of = endpoint_of
        self._choose = choose
        self._learn = learn

    def choose(
        self, endpoint: str, model: str | None, units: Sequence[Unit], steps: Sequence[Step]
    ) -> Choice | None:
        """The hosted target to send a batch to through its own batch API (chat
        completions, Messages or Responses), or None: the items go online."""
        if endpoint not in (CHAT, MESSAGES, RESPONSES) or model is None:
            return None
        return self._choose(model, units, steps)

    def learn(self, target: str, kind: str, samples: Iterable[Sample]) -> None:
        """A finished provider batch's items (planned shared tokens and size, usage as
        billed): the hit share they measured, added to what the plan assumes."""
        if self._learn is not None:
            self._learn(target, kind, samples)

    async def aclose(self) -> None:
        await self._client.aclose()

    def _endpoint(self, target: str) -> Endpoint:
        endpoint = self._endpoint_of(target)
        if self._svc.providers is None or endpoint is None:
            raise ValueError(f"{target} has no batch API here")
        return endpoint

    async def prepare(
        self,
        target: str,
        items: Sequence[tuple[int, dict[str, Any]]],
        who: Principal,
        ttl: str | None = None,
        endpoint: str = CHAT,
    ) -> Submission:
        """Each item (a request of ``endpoint``: chat completions, Messages or Responses,
        the last two served as the chat request they map to) validated as the route
        would, planned and rendered for ``target`` and journaled (an item
        refused is its own error, nothing sent); ``ttl`` "1h": the plan's breakpoint TTL,
        every breakpoint the planner placed takes the long tier (Anthropic's
        ``cache_control`` ``ttl: "1h"``; a client's own marks stand)."""
        self._endpoint(target)
        batch = [(i, b, None) for i, b in items]
        return await self._planned(target, batch, who, ttl, endpoint)

    async def reopen(
        self,
        target: str,
        items: Sequence[tuple[int, dict[str, Any], dict[str, str | None]]],
        who: Principal,
        endpoint: str = CHAT,
    ) -> Submission:
        """The items of a submission made before a restart (each with what the store
        kept of its journal), planned again to read their answers: nothing journaled as
        sent again, each answer journaled in the session its request was recorded in."""
        self._endpoint(target)
        return await self._planned(target, items, who, None, endpoint)

    async def _planned(
        self,
        target: str,
        items: Sequence[tuple[int, dict[str, Any], dict[str, str | None] | None]],
        who: Principal,
        ttl: str | None = None,
        endpoint: str = CHAT,
    ) -> Submission:
        svc, chat = self._svc, self._svc.providers
        assert chat is not None
        journal = svc.loop.journal
        refused: dict[int, Outcome] = {}
        ready: list[_Item] = []
        for idx, body, kept in items:
            rid = (kept or {}).get("request_id") or f"chatcmpl-{uuid.uuid4().hex}"
            asked: tuple[ResponsesRequest, ResponseTools] | None = None
            try:
                if endpoint == MESSAGES:  # served as the chat request it maps to
                    msg = MessagesRequest.model_validate({**body, "stream": False})
                    req = mapped(msg)[0].model_copy(update={"stream": False})
                elif endpoint == RESPONSES:  # likewise
                    resp = ResponsesRequest.model_validate({**body, "stream": False})
                    if resp.previous_response_id is not None:  # the runner keeps such online
                        raise InvalidRequest(
                            "previous_response_id is not served on a provider's batch API",
                            param="previous_response_id",
                        )
                    asked = (resp, response_tools(resp.all_tools()))
                    req = svc.named(chat_request(*asked)[0])
                else:
                    req = svc.named(ChatCompletionRequest.model_validate({**body, "stream": False}))
                if req.model != target and target not in svc.resolve(req.model):
                    raise InvalidRequest(f"'{req.model}' is not served by {target}", param="model")
                p = await chat.prepare(target, Call(req, who, rid))
                if ttl == "1h" and kept is None:
                    p = _long_tier(p)
                op = journal.open(who.tenant, p.header, p.turns, None)
                if kept is None:
                    s = p.sent
                    await journal.sent(op, s.request_id, s.target, s.render, s.directives, s.body)
                elif op is not None:  # its dispatch is in the log already
                    op.session_id = kept.get("session_id")
            except ValidationError as exc:
                err = invalid_request_from(exc.errors())
                refused[idx] = Outcome(err.status, rid, error=error_of(err))
                continue
            except APIError as exc:
                refused[idx] = Outcome(exc.status, rid, error=error_of(exc))
                continue
            resumed = kept is not None
            ready.append(_Item(idx, req, p, op, p.request_id, resumed, endpoint, req.model, asked))
        return Submission(target, ready, refused)

    async def ticket(self, sub: Submission) -> Ticket:
        """What names ``sub``'s submission before it is made (kept in the store first, so
        a restart finds the batch a lost create made): a fresh token (OpenAI: sent as the
        batch's metadata) and what else the provider finds it by (Anthropic: the batches
        there before it).  :class:`BatchAPIError` when the provider cannot be read."""
        lookup = await self._client.lookup(self._endpoint(sub.target))
        return Ticket(f"vcache-{uuid.uuid4().hex}", lookup)

    async def submit(self, sub: Submission, ticket: Ticket) -> str:
        """Send the ready items as one batch named by ``ticket`` (tried again after a 429,
        5xx or timeout, bounded): its id at the provider.  :class:`BatchAPIError` when it
        never took."""
        lines = [(f"i{it.idx}", it.prepared.planned.rendered) for it in sub.items]
        endpoint = self._endpoint(sub.target)
        return await self._client.submit(endpoint, lines, ticket.token, ticket.lookup)

    async def made(self, target: str, ticket: Ticket, n: int) -> str | None:
        """The provider's id of the batch of ``n`` items a submission named by ``ticket``
        made (one kept before its create whose answer was never written: the gateway
        stopped), or None: the provider never made it.  :class:`BatchAPIError` when the
        provider cannot be read."""
        return await self._client.made(self._endpoint(target), ticket.token, ticket.lookup, n)

    def failed(self, sub: Submission, exc: BatchAPIError) -> dict[int, Outcome]:
        """Every ready item's error when the submission never took (named
        ``provider_batch_submit_failed``)."""
        log.warning("batch to %s's batch API failed: %s", sub.target, exc)
        bad = BadGateway(f"the provider's batch API failed: {exc}", code=SUBMIT_FAILED)
        return {it.idx: Outcome(502, it.request_id, error=error_of(bad)) for it in sub.items}

    async def finish(
        self, sub: Submission, run_id: str, cancelled: Callable[[], Awaitable[bool]]
    ) -> dict[int, Settled]:
        """Wait for the provider's batch ``run_id`` (cancelled there once ``cancelled()``),
        then each item's outcome: answered, its error, or never run (canceled, expired)."""
        try:
            done = await self._client.wait(self._endpoint(sub.target), run_id, cancelled)
        except BatchAPIError as exc:
            log.warning("batch %s on %s's batch API failed: %s", run_id, sub.target, exc)
            bad = BadGateway(f"the provider's batch failed: {exc}")
            return {it.idx: Outcome(502, it.request_id, error=error_of(bad)) for it in sub.items}
        journal = self._svc.loop.journal
        out: dict[int, Settled] = {}
        for it in sub.items:
            result = done.of(f"i{it.idx}")
            if result == "canceled" or result == "expired":
                out[it.idx] = result
            else:
                out[it.idx] = await self._answered(it, result, journal)
        return out

    async def _answered(self, it: _Item, result: Any, journal: Any) -> Outcome:
        p, rid = it.prepared, it.request_id
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
        shaped: BaseModel
        if it.endpoint == MESSAGES:
            shaped = await whole_message(message_id(), it.model, _pieces(answer, usage))
        else:
            shaped = await chat_completion(
                rid, it.req.model, _pieces(answer, usage), chat_shape(it.req)
            )
            if it.asked is not None:  # a Responses item: its chat answer as the Response
                shaped = response_of(*it.asked, shaped)
        await journal.answered(it.op, rid, answer.text, usage)
        if not it.resumed:  # planned again after a restart: not the call that was sent
            self._svc.providers.settle(p, usage)  # type: ignore[union-attr]
        out = shaped.model_dump(mode="json")
        return Outcome(200, rid, body=out, usage=usage_of(out))
