"""A batch sent to its hosted provider's own batch API, where the provider plan chose it.

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
(:meth:`ProviderBatches.made`) rather than make a second.  One that cannot be followed
after a restart (its target's batch API no longer configured here, or whether it was
made cannot be told: :class:`Unreadable`) ends each item it carries with a named error
(:meth:`ProviderBatches.unreadable`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from engines.providers.base import Answer
from gateway.batches.provider_client import (
    SUBMIT_FAILED,
    BatchAPIClient,
    BatchAPIError,
    Endpoint,
    Unreadable,
)
from gateway.batches.provider_plan import Choice, Sample
from gateway.batches.send import CHAT, MESSAGES, RESPONSES, Outcome, error_of, usage_of
from gateway.core.errors import APIError, BadGateway, InvalidRequest, invalid_request_from
from gateway.core.messages_wire import MessagesRequest
from gateway.core.pieces import Piece, ToolCallDelta
from gateway.core.responses_wire import ResponseObject, ResponsesRequest
from gateway.core.samples import Sample as AnswerSample
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

UNREADABLE = "provider_batch_unreadable"  # an item of a submission that cannot be followed


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


def _piece(a: Answer) -> Piece:
    """A provider's whole answer as the one piece that carries it."""
    parts = tuple(ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(a.tool_calls))
    return Piece(
        a.text,
        a.finish_reason,
        tool_calls=parts,
        thinking=a.thinking,
        stop_sequence=a.stop_sequence,
    )


async def _pieces(whole: Piece, usage: Any) -> AsyncGenerator[Piece, None]:
    yield whole
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
        choose: Callable[[str, Sequence[Unit], Sequence[Step]], Choice | None] | None,
        learn: Callable[[str, str, Iterable[Sample]], object] | None = None,
    ) -> None:
        """``endpoint_of(target name)``: the target's :class:`Endpoint` (None: not one
        whose batch API is served); ``choose(model, units, steps)``: the target whose
        batch API the provider plan chooses, with its TTL (None: online; ``choose``
        None: every batch online, only the submissions kept before a restart followed);
        ``learn(target, kind, samples)``: a finished batch's measured hit share, to the
        plan."""
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
        if endpoint not in (CHAT, MESSAGES, RESPONSES) or model is None or self._choose is None:
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
        """``target``'s batch API; :class:`Unreadable` when it is not configured here
        (its provider, or the provider's key, removed since a submission went to it)."""
        endpoint = self._endpoint_of(target)
        if self._svc.providers is None or endpoint is None:
            raise Unreadable(f"{target}'s batch API is not configured here")
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
        sent again, each answer journaled in the session its request was recorded in; an
        item is not refused for its model no longer routing to ``target`` (it was sent
        there).  :class:`Unreadable` when ``target``'s batch API is not configured here."""
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
                if kept is None and req.model != target and target not in svc.resolve(req.model):
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

    def unreadable(
        self,
        target: str,
        run_id: str,
        items: Mapping[int, Mapping[str, str | None]],
        exc: Unreadable,
    ) -> dict[int, Outcome]:
        """Every item of the submission to ``target`` kept as ``run_id`` (its id at the
        provider, or the token it was made under) that this gateway cannot follow
        (``exc``), with what the store kept of each: a 502 named
        ``provider_batch_unreadable`` that says which batch to look for there."""
        log.warning("submission %s to %s cannot be followed: %s", run_id, target, exc)
        bad = BadGateway(
            f"this item went to {target}'s batch API before a restart (batch {run_id}) "
            f"and its answer cannot be read here: {exc}",
            code=UNREADABLE,
        )
        return {
            idx: Outcome(502, kept.get("request_id") or run_id, error=error_of(bad))
            for idx, kept in items.items()
        }

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
        whole = _piece(answer)
        shaped: BaseModel
        if it.endpoint == MESSAGES:
            shaped = await whole_message(message_id(), it.model, _pieces(whole, usage))
        else:
            shaped = await chat_completion(
                rid, it.req.model, _pieces(whole, usage), chat_shape(it.req)
            )
            if it.asked is not None:  # a Responses item: its chat answer as the Response
                shaped = response_of(*it.asked, shaped)
        sample = AnswerSample()
        sample.add(whole)
        await journal.sampled(it.op, rid, sample, usage)  # with its tool calls, as online
        if isinstance(shaped, ResponseObject):
            await self._stored(it.op, shaped)
        if not it.resumed:  # planned again after a restart: not the call that was sent
            self._svc.providers.settle(p, usage)  # type: ignore[union-attr]
        out = shaped.model_dump(mode="json")
        return Outcome(200, rid, body=out, usage=usage_of(out))

    async def _stored(self, op: Any, body: ResponseObject) -> None:
        """Keep a Responses item's Response where ``GET /v1/responses/{id}`` and a later
        ``previous_response_id`` find it, at its answer in the session log, as the
        Responses API keeps an online one (nothing without a session log)."""
        log = self._svc.log
        if log is None or op is None or op.session_id is None or op.answer_seq is None:
            return
        add = log.store.add_response
        body_json = body.model_dump_json()
        await asyncio.to_thread(
            add, body.id, op.session_id, op.answer_seq, op.tenant, body_json, body.store
        )
