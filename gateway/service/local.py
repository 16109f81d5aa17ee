"""Requests served by the local replicas, as answer pieces.

Admit first (a refused request costs nothing) → tokenize with the model's
template → check the context → journal what vLLM will be handed (token ids,
cache salt, sampling) → route to a replica (:mod:`gateway.local.dispatch`)
→ stream → fold usage and journal the answer.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

from engines.base import Engine, GenerateRequest, SamplingOptions, Structured
from engines.tokenizer import ChatTokenizer
from engines.vllm.tool_calls import ToolCallParser, known_parser
from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import InvalidRequest, Unavailable
from gateway.core.outputs import Usage
from gateway.core.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    tool_calls_json,
)
from gateway.core.shaping import Piece, Pieces, Sample
from gateway.core.tracing import RequestTrace
from gateway.core.types import Principal, RouteOverride, Served, tenant_salt
from gateway.local.dispatch import Dispatch, Dispatcher, Totals
from gateway.local.governor import LocalGovernor
from gateway.local.retention import BreakpointLeases
from gateway.local.spans import KVSpans
from gateway.service.journal import Journal
from gateway.service.tools import ToolPlan
from gateway.sessions.log import Open
from gateway.sessions.render import (
    local_messages,
    request_config,
    request_parts,
    split_messages,
    vllm_payload,
)
from manifest.canonical import canonical_json
from manifest.sessionlog import Header, MessageEvent

SystemPrompts = tuple[str, ...]
Turns = tuple[MessageEvent, ...]


class LocalChat:
    def __init__(
        self, dispatcher: Dispatcher, journal: Journal, tool_parser: str = "hermes"
    ) -> None:
        self.dispatcher = dispatcher
        self.journal = journal
        self.tool_parser = tool_parser  # vLLM's parser for the model's tool-call format
        self._parser: tuple[ChatTokenizer, ToolCallParser] | None = None
        self.governor: LocalGovernor | None = None  # pins anchors worth holding
        self._anchor_len: OrderedDict[tuple[SystemPrompts, bytes, Turns], int] = OrderedDict()
        self.leases = BreakpointLeases()  # the KV blocks through clients' breakpoints

    @property
    def engine(self) -> Engine:
        """A serving replica's engine (the first one when none serves): all replicas serve
        the same model and tokenizer."""
        d = self.dispatcher
        serving = d.serving()
        return serving[0].engine if serving else d.replicas[0].engine

    @property
    def ready(self) -> bool:
        """Started, and (unless provider-only) at least one local replica serving."""
        d = self.dispatcher
        return d.started and (not d.replicas or bool(d.serving()))

    def check_ready(self) -> None:
        d = self.dispatcher
        if d.failed is not None:
            raise Unavailable("the local engine failed to start", code="engine_failed")
        if not d.started:
            raise Unavailable(
                "the engine is still starting", code="engine_starting", retry_after_s=5
            )
        if not self.ready:
            raise Unavailable(
                "the local engine is not running; it is being restarted",
                code="engine_unavailable",
                retry_after_s=d.retry_after_s(),
            )

    # ------------------------------------------------------------ tokens

    def chat_tokens(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, rendered from the
        parts the session log keeps (so a rebuilt request renders the same)."""
        return self._render(*split_messages(messages), tools)

    def _render(
        self, system: SystemPrompts, turns: Turns, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        # the tools as the log keeps them (canonical JSON), so a rebuilt prompt is the same
        kept = json.loads(canonical_json(tools)) if tools else None
        return self.engine.tokenizer.render_chat(local_messages(system, turns), kept)

    def text_tokens(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        """Client-given token ids, each inside the model's vocabulary (else a 400): the
        larger of the tokenizer's and the model's, as vLLM's own check."""
        engine = self.engine
        vocab = max(engine.tokenizer.vocab_size, engine.capabilities.vocab_size or 0)
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise InvalidRequest(
                    f"Invalid value for '{param}[{i}]': token id {t} is outside the model's "
                    f"vocabulary (0 to {vocab - 1})",
                    param=f"{param}[{i}]",
                    code="invalid_value",
                )
        return ids

    # ------------------------------------------------------------ chat

    def _chat_request(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        rid: str,
        system: SystemPrompts,
        turns: Turns,
    ) -> tuple[GenerateRequest, ToolPlan | None]:
        self.check_ready()
        plan = self._tool_plan(req)
        ids = self._render(system, turns, req.tool_dicts())
        limit_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        fmt = req.structured()
        structured = plan.structured() if plan is not None else None
        if fmt is not None:
            schema = fmt.json_schema
            text = canonical_json(schema.schema_).decode() if schema and schema.schema_ else None
            structured = Structured(json_schema=text, json_object=text is None)
        greq = self._generate_request(
            rid, ids, req, req.output_limit(), ("messages", limit_param), who,
            logprobs=req.top_logprobs_asked(), structured=structured,
            clamp=req.hints.clamp_output, top_k=req.hints.top_k,
        )  # fmt: skip
        return greq, plan

    async def chat(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None,
        served: Served,
        rid: str,
        session: str | None,
        trace: RequestTrace,
    ) -> Pieces:
        with self.dispatcher.admit():
            t0 = time.perf_counter()
            system, turns = request_parts(req)  # what is rendered is what is journaled
            with trace.step("tokenize") as span:
                greq, plan = self._chat_request(req, who, rid, system, turns)
                span.set_attribute("vcache.prompt_tokens", greq.num_prompt_tokens)
            with trace.step("journal"):
                op = await self._journal(req, who, greq, session, served, system, turns)
            d = await self._route(greq, route, trace)
            served.target, served.dispatch, served.lint = LOCAL_TARGET, d, ()
            asked = req.output_limit()
            if asked is not None and greq.sampling.max_tokens < asked:
                served.clamped_max_tokens = greq.sampling.max_tokens
            kv = self.dispatcher.kv
            if self.governor is not None and kv is not None and d.hashes and system:
                n = self._anchor_tokens(system, req, greq.prompt_token_ids)
                self.governor.observe(d.replica_id, d.hashes, n // kv.block_size)
            pieces = self._generate(greq, d, "chat", t0, trace)
            if plan is not None:
                pieces = plan.stream(pieces)
            if req.hints.breakpoints:
                ends = self._breakpoint_ends(system, turns, req, greq.prompt_token_ids)
                owner = f"breakpoints:{who.tenant}:{served.session or rid}"
                pieces = self._retained(pieces, d, ends, owner)
            async with aclosing(self._journaled(pieces, op, served, rid)) as out:
                async for p in out:
                    yield p

    def _anchor_tokens(
        self, system: SystemPrompts, req: ChatCompletionRequest, ids: Sequence[int]
    ) -> int:
        """How many leading tokens the system prompts (and tools) render to, as a prefix
        of the whole prompt."""
        return self._prefix_tokens(system, (), req.tool_dicts(), ids)

    def _prefix_tokens(
        self,
        system: SystemPrompts,
        turns: Turns,
        tools: list[dict[str, Any]],
        ids: Sequence[int],
    ) -> int:
        """How many leading tokens of ``ids`` the system prompts, tools and ``turns``
        render to: remembered per (system, tools, turns), the last 1024."""
        key = (system, canonical_json(tools) if tools else b"", turns)
        n = self._anchor_len.get(key)
        if n is None:
            head = self._render(system, turns, tools)
            n = 0
            while n < min(len(head), len(ids)) and head[n] == ids[n]:
                n += 1
            self._anchor_len[key] = n
            if len(self._anchor_len) > 1024:
                self._anchor_len.popitem(last=False)
        else:
            self._anchor_len.move_to_end(key)
        return n

    def _breakpoint_ends(
        self, system: SystemPrompts, turns: Turns, req: ChatCompletionRequest, ids: Sequence[int]
    ) -> list[tuple[int, int]]:
        """(token position, TTL) of each client breakpoint: where the prompt through its
        marked segment ends.  A mark on the last turn covers the whole prompt (only the
        template's few tokens that open the answer follow it)."""
        out = []
        for bp in req.hints.breakpoints:
            if bp.segment in ("tools", "system"):
                pos = self._anchor_tokens(system, req, ids)
            else:
                i = int(bp.segment.partition(":")[2])
                last = i >= len(turns) - 1
                pos = len(ids) if last else self._prefix_tokens(
                    system, turns[: i + 1], req.tool_dicts(), ids
                )  # fmt: skip
            out.append((pos, bp.ttl_s))
        return out

    async def _retained(
        self, pieces: Pieces, d: Dispatch, ends: list[tuple[int, int]], owner: str
    ) -> Pieces:
        """The pieces; at the end, the blocks through each breakpoint leased on the replica
        for its TTL, and the usage says how many prompt tokens were newly cached through
        the last breakpoint (Anthropic's ``cache_creation_input_tokens``)."""
        kv = self.dispatcher.kv
        block = kv.block_size if kv is not None else self.engine.capabilities.block_size
        async with aclosing(pieces):
            async for p in pieces:
                if p.usage is not None:
                    u = p.usage
                    cached = u.prompt_tokens_details.cached_tokens
                    through = max(pos for pos, _ in ends) // block * block
                    written = max(0, min(through, u.prompt_tokens) - cached)
                    usage = Usage.of(u.prompt_tokens, u.completion_tokens, cached, written)
                    p = dataclasses.replace(p, usage=usage)
                    if kv is not None and d.hashes:
                        await self._lease(kv, d, ends, owner, block)
                yield p

    async def _lease(
        self, kv: KVSpans, d: Dispatch, ends: list[tuple[int, int]], owner: str, block: int
    ) -> None:
        tiers: dict[int, int] = {}  # TTL → the furthest position marked with it
        for pos, ttl in ends:
            tiers[ttl] = max(tiers.get(ttl, 0), pos)
        for ttl, pos in sorted(tiers.items()):
            n = min(pos // block, len(d.hashes))
            await self.leases.hold(kv, d.replica.id, f"{owner}:{ttl}s", d.hashes[:n], ttl)

    def _tool_plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        if not req.tools or req.tool_choice == "none":
            return None
        tok = self.engine.tokenizer
        if self._parser is None or self._parser[0] is not tok:
            if not known_parser(self.tool_parser):
                raise Unavailable(
                    f"tools need a tool-call parser: engine.tool_parser "
                    f"'{self.tool_parser}' is not one of vLLM's",
                    code="tool_parser_unknown",
                )
            self._parser = (tok, ToolCallParser(self.tool_parser, tok))
        parser = self._parser[1]
        return ToolPlan(req, parser.parse, parser.start_marker)

    async def _journal(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        greq: GenerateRequest,
        session: str | None,
        served: Served,
        system: SystemPrompts,
        turns: Turns,
    ) -> Open | None:
        """Journal what vLLM will be handed (token ids, salt, sampling), before routing."""
        tools = req.tool_dicts() or None
        header = Header.make(req.model, LOCAL_TARGET, system, tools, request_config(req, None))
        op = self.journal.open(who.tenant, header, turns, session)
        if op is None:
            return None
        sampling = dataclasses.asdict(greq.sampling)
        sent = vllm_payload(greq.prompt_token_ids, greq.cache_salt, sampling)
        directives = {"cache_salt": greq.cache_salt, "sampling": sampling}
        await self.journal.sent(op, served, greq.request_id, LOCAL_TARGET, "vllm", directives, sent)
        return op

    async def _route(
        self, greq: GenerateRequest, route: RouteOverride | None, trace: RequestTrace
    ) -> Dispatch:
        with trace.step("route") as span:
            d = await self.dispatcher.route(greq, route)
            span.set_attribute("vcache.replica", d.replica_id)
            if d.predicted_cached_tokens is not None:
                span.set_attribute("vcache.predicted_cached_tokens", d.predicted_cached_tokens)
        return d

    async def _generate(
        self, greq: GenerateRequest, d: Dispatch, endpoint: str, t0: float, trace: RequestTrace
    ) -> Pieces:
        totals = Totals()
        trace.begin("dispatch", replica=d.replica_id)
        first = True
        async with aclosing(self.dispatcher.run(greq, d, endpoint, t0, totals)) as chunks:
            async for c in chunks:
                if first:  # the first token: the engine scheduled and prefilled it
                    trace.finish("dispatch", cached_tokens=c.num_cached_tokens or 0)
                    trace.begin("generate")
                    first = False
                    yield Piece(
                        c.text, c.finish_reason, index=c.index, logprobs=c.logprobs,
                        prompt_tokens=c.num_prompt_tokens, cached_tokens=c.num_cached_tokens,
                    )  # fmt: skip
                    continue
                yield Piece(c.text, c.finish_reason, index=c.index, logprobs=c.logprobs)
        trace.finish("generate", completion_tokens=totals.completion)
        yield Piece(usage=totals.usage())

    async def _journaled(self, pieces: Pieces, op: Open | None, served: Served, rid: str) -> Pieces:
        """The pieces, and the answer journaled before its usage goes out: the text and
        tool calls of sample 0, the one the conversation goes on with."""
        answer = Sample()
        async with aclosing(pieces):
            async for p in pieces:
                if p.usage is not None:
                    out = answer.tool_calls()
                    called = tool_calls_json([c.model_dump() for c in out]) if out else None
                    text = "".join(answer.text)
                    await self.journal.answered(op, served, rid, text, p.usage, called)
                elif p.index == 0:
                    answer.add(p)
                yield p

    # ------------------------------------------------------- completions

    def _completion_request(
        self, req: CompletionRequest, who: Principal, rid: str
    ) -> GenerateRequest:
        self.check_ready()
        p, param = req.prompt, "prompt"
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p, param = p[0], "prompt[0]"
        tok = self.engine.tokenizer
        ids = tok.encode(p) if isinstance(p, str) else self.check_token_ids(p, param)  # type: ignore[arg-type]
        if not ids:
            raise InvalidRequest("prompt must not be empty", param="prompt", code="invalid_value")
        return self._generate_request(
            rid, ids, req, req.max_tokens, ("prompt", "max_tokens"), who, logprobs=req.logprobs
        )

    async def completion(
        self,
        req: CompletionRequest,
        who: Principal,
        route: RouteOverride | None,
        served: Served,
        rid: str,
        trace: RequestTrace,
    ) -> Pieces:
        with self.dispatcher.admit():
            t0 = time.perf_counter()
            with trace.step("tokenize"):
                greq = self._completion_request(req, who, rid)
            served.dispatch = d = await self._route(greq, route, trace)
            async with aclosing(self._generate(greq, d, "completions", t0, trace)) as pieces:
                async for p in pieces:
                    yield p

    # ---------------------------------------------------------- limits

    def _generate_request(
        self,
        rid: str,
        ids: list[int],
        req: SamplingFields,
        limit: int | None,
        params: tuple[str, str],
        who: Principal,
        logprobs: int | None = None,
        structured: Structured | None = None,
        clamp: bool = False,
        top_k: int | None = None,
    ) -> GenerateRequest:
        prompt_param, limit_param = params
        max_len = self.engine.capabilities.max_model_len
        if len(ids) >= max_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_len} tokens; "
                f"the prompt has {len(ids)} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = max_len - len(ids)
        if clamp and limit is not None:  # coding agents ask for far more than fits
            limit = min(limit, room)
        if limit is not None and limit > room:
            raise InvalidRequest(
                f"max_tokens is {limit}, but the prompt has {len(ids)} tokens and the "
                f"model's maximum context length is {max_len}: at most {room} can be generated",
                param=limit_param,
                code="context_length_exceeded",
            )
        sampling = SamplingOptions(
            max_tokens=room if limit is None else limit,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k or 0,
            stop=req.stop_list(),
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            ignore_eos=req.ignore_eos,
            n=req.n,
            logprobs=logprobs,
            structured=structured,
        )
        return GenerateRequest(
            request_id=rid,
            prompt_token_ids=tuple(ids),
            sampling=sampling,
            cache_salt=tenant_salt(who.tenant),
        )
