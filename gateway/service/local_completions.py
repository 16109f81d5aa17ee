"""Text completions on the local model (``POST /v1/completions``, gRPC ``Completion``)
as a :class:`~gateway.core.target.Target`: each prompt of a request is an engine
request of its own (a :class:`~gateway.core.target.Call` whose request is a
:class:`~gateway.core.completion_request.TextPrompt`), and the service loop
serves them all (:meth:`~gateway.service.loop.ServiceLoop.first_answer_each`).

prepare: the prompt tokenized (a text, on the render thread, with the
tokenizer's special tokens where asked) or its ids checked against the
vocabulary, truncated where asked, checked against the context; nothing
claimed → the loop journals the prompt as the one entry of its conversation
(:func:`manifest.sessionlog.prompt_entry`) and what vLLM will be handed (token
ids, cache salt, sampling, and the ``prompt`` directive that says how the
prompt became those ids) → acquire (the ``route`` step): routed and predicted
on its own, registered as a running prefill → send: streamed from the replica
→ release gives the registration back on every path.  The prompts' answers are
merged into the request's (completions.py), echoed where asked
(:meth:`LocalCompletions.join`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from engines.base import GenerateRequest
from gateway.core.completion_request import CompletionRequest, TextPrompt
from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import APIError, InvalidRequest
from gateway.core.outputs import Usage
from gateway.core.pieces import Pieces
from gateway.core.target import Call, Quote, Sent
from gateway.core.tracing import RequestTrace
from gateway.core.types import Placement, Principal, RouteOverride, request_salt
from gateway.local.dispatch import Dispatch
from gateway.service.completions import Echo, echoed, merged, prompt_list
from gateway.service.engine_request import sent_to_engine
from gateway.service.json_text import JsonText, json_answer
from gateway.service.local import LocalChat
from gateway.service.loop import Join
from gateway.sessions.render import text_config, text_prompt, text_shaping
from manifest.sessionlog import Header, MessageEvent, prompt_entry

COMPLETION_MAX_TOKENS = 16  # text completions without max_tokens, as OpenAI's and vLLM's


def prompt_calls(
    req: CompletionRequest,
    who: Principal,
    rid: str,
    route: RouteOverride | None,
    trace: RequestTrace,
) -> list[Call]:
    """Each prompt of ``req`` as a call of its own: the first under the request's id
    ``rid`` (the response's), prompt ``i`` under ``rid-p<i>``."""
    return [
        Call(TextPrompt(req, p, param), who, f"{rid}-p{i}" if i else rid, None, route, trace)
        for i, (p, param) in enumerate(prompt_list(req))
    ]


@dataclass(frozen=True)
class TextPrepared:
    """A text completion's prompt tokenized: what vLLM will be handed.  Acquired, it is
    routed to a replica: ``dispatch`` holds the replica and the prompt's prefill
    registration."""

    call: Call
    greq: GenerateRequest
    header: Header
    turns: tuple[MessageEvent, ...]
    shaping: Mapping[str, Any]  # how the prompt became its ids (the ``prompt`` directive)
    t0: float
    target: str = LOCAL_TARGET
    notes: Mapping[str, str] = field(default_factory=dict)
    dispatch: Dispatch | None = None  # set by acquire: the claim release gives back

    @property
    def placement(self) -> Placement | None:
        return self.dispatch

    @property
    def sent(self) -> Sent:
        return sent_to_engine(self.greq, {"prompt": dict(self.shaping)})


class LocalCompletions:
    """The local replicas as the target of text completions' prompts (and of cache warms
    named by a prompt or token ids)."""

    def __init__(self, local: LocalChat) -> None:
        self.local = local

    # ------------------------------------------------------- the Target

    def admission(self, call: Call) -> AbstractContextManager[None]:
        return self.local.admission(call)

    async def quote(self, name: str, call: Call) -> Quote[list[int]] | None:
        """The prompt's tokens and the most of them a serving replica holds now, at the
        local price (as a chat's quote)."""
        local = self.local
        if not local.ready:
            return None
        try:
            ids, _ = await self._ids(call.text)
        except APIError:
            return None  # its prepare says what is wrong, in the API's terms
        cached = 0
        if local.input_price > 0:
            salt = request_salt(call.who.tenant, call.text.request.cache_salt)
            cached = local.dispatcher.held(ids, salt)
        return Quote(name, len(ids), cached, local.input_price, memo=ids)

    async def prepare(
        self, name: str, call: Call, quote: Quote[list[int]] | None = None
    ) -> TextPrepared:
        """Tokenize the prompt (or check its ids), truncate it where asked, check the
        context and a forced replica.  Nothing is routed or claimed: that is
        :meth:`acquire`, after the journal."""
        t0 = time.perf_counter()
        local, asked = self.local, call.text
        req = asked.request
        with call.trace.step("tokenize") as span:
            local.check_ready()
            local.dispatcher.forced(call.route)  # an unknown replica: 404, nothing journaled
            ids, shaping = await self._ids(asked, quote.memo if quote is not None else None)
            limit = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
            greq = local.engine_request(
                call.request_id,
                ids,
                req,
                max(limit, 1),  # 0 (with echo): one token generated, none answered, as vLLM
                (asked.param, "max_tokens"),
                call.who,
                logprobs=req.logprobs,
                clamp=req.max_tokens is None,  # the default fits what the context leaves
                prompt_logprobs=req.prompt_logprobs_asked(),
            )
            span.set_attribute("vcache.prompt_tokens", greq.num_prompt_tokens)
        header = Header.make(req.model, LOCAL_TARGET, (), None, text_config(req, greq.lora))
        turns = (prompt_entry(asked.prompt),)
        return TextPrepared(call, greq, header, turns, shaping, t0)

    async def _ids(
        self, asked: TextPrompt, memo: list[int] | None = None
    ) -> tuple[list[int], dict[str, Any]]:
        """The prompt's token ids as vLLM is handed them (``memo``: made already, to
        quote), and how they were made: a text tokenized on the render thread, ids checked
        against the vocabulary; truncated where asked."""
        local, req, prompt = self.local, asked.request, asked.prompt
        keep = req.prompt_keep(local.engine.capabilities.max_model_len)
        shaping = text_shaping(prompt, req.add_special_tokens, keep, req.truncation_side)
        if memo is not None:
            ids = memo
        elif isinstance(prompt, str):
            ids = await local.text_prompt(prompt, shaping)
        else:
            given = local.check_token_ids(prompt, asked.param)
            ids = text_prompt(local.engine.tokenizer, given, shaping)
        if not ids:
            raise InvalidRequest(
                "prompt must not be empty", param=asked.param, code="invalid_value"
            )
        return ids, shaping

    async def acquire(self, p: TextPrepared) -> TextPrepared:
        """Route ``p`` (the ``route`` step: the index sync, the router's choice over the
        serving replicas, a running prefill of the same prefix to join) and register its
        prompt as a running prefill, which :meth:`release` gives back."""
        if p.dispatch is not None:
            return p
        d = await self.local.route(p.greq, p.call.route, p.call.trace)
        return dataclasses.replace(p, dispatch=d)

    def send(self, p: TextPrepared, session: str | None) -> Pieces:
        if p.dispatch is None:  # sending what was never acquired is a bug
            raise RuntimeError(f"{p.greq.request_id}: sent before it was routed")
        steps = (JsonText(),) if json_answer(p.greq) else ()
        return self.local.pieces(p.greq, p.dispatch, "completions", p.t0, p.call.trace, steps=steps)

    def retry(self, p: TextPrepared, error: Exception) -> TextPrepared | None:
        return None  # another replica is the router's choice, made before the send

    def settle(self, p: TextPrepared, usage: Usage) -> None:
        """Nothing left: the prediction was folded when vLLM reported its cached tokens."""

    def release(self, p: TextPrepared) -> None:
        if p.dispatch is not None:
            self.local.dispatcher.release(p.dispatch)

    # ------------------------------------------------------- the answer

    def join(self, req: CompletionRequest) -> Join:
        """How the prompts' answers make the request's: merged (prompt i's sample j is
        choice ``i * n + j``, one usage, the sum; one prompt's as it is), each choice
        starting with its prompt where ``echo`` asks."""

        def join(streams: Sequence[Pieces]) -> Pieces:
            pieces = streams[0] if len(streams) == 1 else merged(streams, req.n)
            if not req.echo:
                return pieces
            decode = self.local.engine.tokenizer.decode
            echo = Echo(  # token prompts echoed with their special tokens, as vLLM's
                texts=[p if isinstance(p, str) else decode(p, False) for p, _ in prompt_list(req)],
                decode=decode,
                logprobs=req.logprobs is not None,
                generated=req.max_tokens != 0,
            )
            return echoed(pieces, echo, req.n)

        return join
