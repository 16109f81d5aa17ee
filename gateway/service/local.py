"""The local replicas as the :class:`~gateway.core.target.Target` of chat calls (text
completions' prompts are :mod:`gateway.service.local_completions`'s, over the same
replicas).

prepare: tokenize with the model's template (tools and tool turns through it),
check the context and a forced replica; nothing claimed → the service loop
journals what vLLM will be handed (token ids, cache salt, sampling) →
acquire (the ``route`` step): sync the index, weigh pin room for a new session's
lease, route to a replica by the predicted cached prefix, join a running
prefill of the same prefix there, and register this prompt as one
(:meth:`~gateway.local.dispatch.Dispatcher.route`; the claim is the
:class:`~gateway.local.dispatch.Dispatch`, given back by ``release`` on every
path) → send: stream from the replica, read tool calls out of the text, lease
the blocks through a client's breakpoints → the usage is folded as vLLM
reports it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, aclosing
from dataclasses import dataclass, field
from typing import Any

from engines.base import Engine, GenerateRequest, Structured
from engines.lora import LoraRef
from engines.providers.base import effective_effort
from engines.tokenizer import ChatTokenizer
from engines.vllm.tool_calls import ToolCallParser, known_parser
from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import APIError, InvalidRequest, NotFound, Unavailable
from gateway.core.outputs import Usage
from gateway.core.pieces import Piece, Pieces, Step, ended, stepped
from gateway.core.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    SamplingFields,
    TextPart,
)
from gateway.core.target import Call, Quote, Sent
from gateway.core.tracing import RequestTrace
from gateway.core.types import (
    Placement,
    Principal,
    RouteOverride,
    request_salt,
)
from gateway.local.adapters import Adapters
from gateway.local.coalesce import Pace, slowest
from gateway.local.dispatch import Dispatch, Dispatcher, Totals
from gateway.local.governor import LocalGovernor
from gateway.local.pauses import Paused, SessionTurns
from gateway.local.retention import BreakpointLeases
from gateway.local.vision_prompt import VisionPrompt, VisionRenderer
from gateway.service.breakpoints import Ends, Retained, SystemPrompts, Turns
from gateway.service.context_edits import CLEAR_TOOL_USES, clear_tool_uses, tool_use_edit
from gateway.service.engine_request import (
    Room,
    check_token_ids,
    generate_request,
    sent_to_engine,
    vocab_size,
)
from gateway.service.json_text import JsonText, json_answer
from gateway.service.prompts import Prompts
from gateway.service.tools import ToolPlan
from gateway.service.vision_request import engine_images, expanded_prompt
from gateway.sessions.render import (
    request_config,
    request_parts,
    split_messages,
)
from manifest.canonical import canonical_json
from manifest.hashing import MMSpan
from manifest.index import LocationId
from manifest.sessionlog import Header


@dataclass(frozen=True)
class LocalPrepared:
    """A chat call tokenized: what vLLM will be handed.  Acquired, it is routed to a
    replica: ``dispatch`` holds the replica and the prompt's prefill registration."""

    call: Call
    greq: GenerateRequest
    plan: ToolPlan | None
    header: Header
    turns: Turns
    system: SystemPrompts
    tools: list[dict[str, Any]]
    t0: float
    ends: Ends = field(default_factory=list)  # the client's breakpoints, in tokens
    notes: Mapping[str, str] = field(default_factory=dict)
    template: Mapping[str, Any] = field(default_factory=dict)  # the prompt shaping, resolved
    anchor: int = 0  # the tokens of the governor's anchor (0: none)
    ceiling: bool = False  # the operator's output ceiling, not the client's, limits it
    target: str = LOCAL_TARGET
    dispatch: Dispatch | None = None  # set by acquire: the claim release gives back

    @property
    def placement(self) -> Placement | None:
        return self.dispatch

    @property
    def routed(self) -> Dispatch:
        """Where acquire routed it (sending what was never acquired is a bug)."""
        if self.dispatch is None:
            raise RuntimeError(f"{self.greq.request_id}: sent before it was routed")
        return self.dispatch

    @property
    def sent(self) -> Sent:
        # a request with no prompt shaping keeps no template key (as logs always had it)
        return sent_to_engine(self.greq, {"template": dict(self.template)} if self.template else {})


class LocalChat:
    def __init__(
        self,
        dispatcher: Dispatcher,
        turns: SessionTurns,
        leases: BreakpointLeases,
        governor: LocalGovernor | None = None,
        tool_parser: str = "hermes",
        trust_chat_template: bool = False,
        input_price: float = 0.0,
        max_output_tokens: int | None = None,
        ceiling_finish: str = "length",
        adapters: Adapters | None = None,
        vision: VisionRenderer | None = None,
        render_inline_chars: int = 0,
        output_interval_s: float = 0.0,
    ) -> None:
        """``turns``: agent sessions (the replica of the last turn, KV leased across
        tool-call pauses; the dispatcher makes room with the same one); ``leases``: the KV
        blocks through clients' breakpoints; ``governor``: pins anchors worth holding;
        ``adapters``: the LoRA adapters served as models (None: none); ``vision``: the
        image prompts' renderer when the model is a vision-language model (None: it
        reads text only); ``render_inline_chars``: a render that tokenizes at most this
        many characters afresh runs on the loop (the render thread idle);
        ``output_interval_s``: a streamed answer's outputs are read at most this often
        (``engine.output_interval_ms``), and asked of vLLM every so many tokens where
        the serving replicas make several in it (0: never)."""
        self.dispatcher = dispatcher
        self.vision = vision
        self.adapters = adapters
        self.replicas = dispatcher.replica_set  # readiness: the supervisor writes it
        self.turns = turns
        self.leases = leases
        self.governor = governor
        self.max_output_tokens = max_output_tokens  # the operator's ceiling per answer
        self.ceiling_finish = ceiling_finish  # how an answer the ceiling cut ends
        self.input_price = input_price  # per million uncached prompt tokens (routing)
        self.trust_chat_template = trust_chat_template  # a request's own chat_template
        self.tool_parser = tool_parser  # vLLM's parser for the model's tool-call format
        self._parser: tuple[ChatTokenizer, ToolCallParser] | None = None
        # templates and tokenizers run off the event loop, a short render on it
        self._prompts = Prompts(render_inline_chars)
        self.output_interval_s = output_interval_s

    @property
    def engine(self) -> Engine:
        """A serving replica's engine (the first one when none serves): all replicas serve
        the same model and tokenizer."""
        d = self.dispatcher
        serving = d.serving()
        return serving[0].engine if serving else d.replicas[0].engine

    @property
    def sees(self) -> bool:
        """Whether the local model takes images (a vision-language model); documents never."""
        return self.vision is not None

    @property
    def ready(self) -> bool:
        """Started, and (unless provider-only) at least one local replica serving."""
        rs = self.replicas
        return rs.started and (not rs.replicas or bool(rs.serving()))

    def check_ready(self) -> None:
        rs = self.replicas
        if rs.failed is not None:
            raise Unavailable("the local engine failed to start", code="engine_failed")
        if not rs.started:
            raise Unavailable(
                "the engine is still starting", code="engine_starting", retry_after_s=5
            )
        if not self.ready:
            raise Unavailable(
                "the local engine is not running; it is being restarted",
                code="engine_unavailable",
                retry_after_s=rs.retry_after_s(),
            )

    # ------------------------------------------------------------ tokens

    def served_adapters(self) -> Adapters:
        """The adapters the replicas serve (the admin routes'); a 400 when LoRA is off."""
        self.check_ready()
        if self.adapters is None or not self.adapters.enabled:
            raise InvalidRequest(
                "the local engines run without LoRA (engine.lora.enabled)",
                param="lora_name",
                code="lora_disabled",
            )
        return self.adapters

    def adapter(self, model: str) -> LoraRef | None:
        """The LoRA adapter ``model`` names (None: the base model, or not an adapter)."""
        return self.adapters.find(model) if self.adapters is not None and model else None

    async def learn_adapters(self) -> None:
        """What adapters the replicas not asked yet hold (a remote replica's own)."""
        if self.adapters is not None:
            await self.adapters.learn_new()

    def check_model(self, model: str, served: str) -> None:
        """``model`` is the local model (served as ``served``) or one of its adapters, and
        it can serve now."""
        self.check_ready()
        local = model == served or self.adapter(model) is not None
        if not local or not self.dispatcher.replicas:
            raise NotFound(
                f"The model '{model}' does not exist", param="model", code="model_not_found"
            )

    def close(self) -> None:
        self._prompts.close()

    async def chat_tokens(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        template: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, rendered from the
        parts the session log keeps (so a rebuilt request renders the same).  The local
        model reads text only: an image or document part is a 400 naming it."""
        for i, m in enumerate(messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if not isinstance(part, TextPart):
                    where = f"messages[{i}].content[{j}]"
                    raise InvalidRequest(
                        f"{where}: the local model reads text only (images and documents "
                        "go to a target that sees them)",
                        param=where,
                        code="unsupported_on_target",
                    )
        system, turns = split_messages(messages)
        return await self._prompts.chat(self.engine.tokenizer, system, turns, tools, template)

    async def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], tuple[MMSpan, ...]]:
        """The token ids ``req`` (its images taken in) is counted and hashed by, each image
        expanded as vLLM's processor expands it, and the images' spans: as :meth:`quote`
        renders it, for ``/tokenize`` and the cache API."""
        system, turns = request_parts(req)
        tools, template = req.tool_dicts(), self._shaping(req)
        ids = await self._prompts.chat(self.engine.tokenizer, system, turns, tools, template)
        vp = await self._expanded(req, ids)
        return (ids, ()) if vp is None else (list(vp.token_ids), vp.spans)

    def _shaping(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """The request's prompt shaping as rendered and journaled: a request's own chat
        template only where trusted, truncation resolved against the context."""
        template = req.template()
        if "chat_template" in template and not self.trust_chat_template:
            raise InvalidRequest(
                "chat_template is passed with the request, but this gateway does not "
                "trust request chat templates (engine.trust_request_chat_template)",
                param="chat_template",
                code="unsupported_parameter",
            )
        req.hints.refuse_anthropic_only("local", applies_edits=True)
        # the Responses / Messages effort in force, to the template as vLLM passes it
        controls = (json.loads(m.control) if m.control else None for m in req.messages)
        effort = effective_effort(req.hints.effort, controls)
        if effort is not None:
            own = template.get("chat_template_kwargs") or {}
            template["chat_template_kwargs"] = {"reasoning_effort": effort, **own}
        keep = req.prompt_keep(self.engine.capabilities.max_model_len)
        if keep is not None:
            template["truncate_prompt_tokens"] = keep
        return template

    async def text_tokens(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return await self._prompts.text(self.engine.tokenizer, text, add_special_tokens)

    async def text_prompt(self, text: str, shaping: Mapping[str, Any]) -> list[int]:
        """A text completion's prompt as vLLM is handed it, made on the render thread."""
        return await self._prompts.text_prompt(self.engine.tokenizer, text, shaping)

    def _vocab(self) -> int:
        return vocab_size(self.engine)

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        """Client-given token ids, each inside the model's vocabulary (else a 400)."""
        return check_token_ids(ids, param, self._vocab())

    # ------------------------------------------------------------ chat

    def _chat_request(
        self, req: ChatCompletionRequest, who: Principal, rid: str, ids: list[int]
    ) -> tuple[GenerateRequest, ToolPlan | None]:
        plan = self._tool_plan(req)
        limit_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        fmt = req.structured()
        structured = plan.structured() if plan is not None else None
        if fmt is not None and structured is None:
            schema = fmt.json_schema
            text = canonical_json(schema.schema_).decode() if schema and schema.schema_ else None
            structured = Structured(json_schema=text, json_object=text is None)
        greq = self.engine_request(
            rid,
            ids,
            req,
            req.output_limit(),
            ("messages", limit_param),
            who,
            logprobs=req.top_logprobs_asked(),
            structured=structured,
            clamp=req.hints.clamp_output,
            top_k=req.hints.top_k,
            prompt_logprobs=req.prompt_logprobs,
        )
        return greq, plan

    # ------------------------------------------------------- the Target

    def admission(self, call: Call) -> AbstractContextManager[None]:
        return self.dispatcher.admit(call.who.priority)

    async def quote(self, name: str, call: Call) -> Quote[list[int]] | None:
        """The prompt's tokens and the most of them a serving replica holds now (the
        exact index as it stands: no sync, nothing routed), at the local price."""
        if not self.ready:
            return None
        req = call.chat
        try:
            system, turns = request_parts(req)
            tools, template = req.tool_dicts(), self._shaping(req)
            ids = await self._prompts.chat(self.engine.tokenizer, system, turns, tools, template)
            vp = await self._expanded(req, ids)
        except APIError:
            return None  # its prepare says what is wrong, in the API's terms
        prompt, spans = (ids, ()) if vp is None else (list(vp.token_ids), vp.spans)
        cached = 0  # free replicas cost nothing whatever they hold: no index walk then
        if self.input_price > 0:
            salt = request_salt(call.who.tenant, req.cache_salt)
            cached = self.dispatcher.held(prompt, salt, self.adapter(req.model), spans)
        return Quote(name, len(prompt), cached, self.input_price, memo=ids)

    async def prepare(
        self, name: str, call: Call, quote: Quote[list[int]] | None = None
    ) -> LocalPrepared:
        """Tokenize with the model's template, check the context and a forced replica.
        Nothing is routed or claimed: that is :meth:`acquire`, after the journal."""
        t0 = time.perf_counter()
        req, who, rid, trace = call.chat, call.who, call.request_id, call.trace
        system, turns = request_parts(req)  # what is rendered is what is journaled
        tools = req.tool_dicts()  # dumped once: the render, the anchor, the header
        with trace.step("tokenize") as span:
            self.check_ready()
            self.dispatcher.forced(call.route)  # an unknown replica: 404, nothing journaled
            template = self._shaping(req)
            memo = quote.memo if quote is not None else None
            # a cache warm is not traffic: the governor weighs what clients send
            anchor, marks = self.governor is not None and not call.warm, req.hints.breakpoints
            r = await self._prompts.rendered(
                self.engine.tokenizer, system, turns, tools, template, anchor, marks, memo
            )
            notes: dict[str, str] = {}
            edit = tool_use_edit(req.hints.context_management)
            edited, cleared = (turns, 0)
            if edit is not None and edit.applies(len(r.ids)):  # as Anthropic applies it
                edited, cleared = clear_tool_uses(turns, edit)
            if edit is not None and cleared:
                again = await self._prompts.rendered(
                    self.engine.tokenizer, system, edited, tools, template, anchor, marks
                )
                freed = len(r.ids) - len(again.ids)
                if edit.clear_at_least <= 0 or freed >= edit.clear_at_least:
                    turns, r = edited, again  # journaled as edited: the log rebuilds it
                    notes["x-vcache-context-edits"] = f"{CLEAR_TOOL_USES}:{cleared}"
            vp = await self._expanded(req, r.ids)
            if vp is None:
                greq, plan = self._chat_request(req, who, rid, r.ids)
            else:  # the engine expands the template ids; the rest counts the expanded
                greq, plan = self._chat_request(req, who, rid, list(vp.token_ids))
                greq = dataclasses.replace(
                    greq, images=engine_images(req, vp), template_token_ids=tuple(r.ids)
                )
                ends = [(vp.position(n), ttl) for n, ttl in r.ends]
                r = dataclasses.replace(r, anchor=vp.position(r.anchor), ends=ends)
            span.set_attribute("vcache.prompt_tokens", greq.num_prompt_tokens)
        asked = req.output_limit()
        given = greq.sampling.max_tokens
        ceiling = given == self.max_output_tokens and (asked is None or asked > given)
        if ceiling or (asked is not None and given < asked):
            notes["x-vcache-max-tokens-clamped"] = str(given)
        config = request_config(req, None, greq.lora)
        header = Header.make(req.model, LOCAL_TARGET, system, tools or None, config)
        return LocalPrepared(
            call,
            greq,
            plan,
            header,
            turns,
            system,
            tools,
            t0,
            r.ends,
            notes,
            template,
            r.anchor,
            ceiling,
        )

    async def acquire(self, p: LocalPrepared) -> LocalPrepared:
        """Route ``p`` (the ``route`` step: the index sync, pin room for a new session's
        lease, the router's choice, a running prefill of the same prefix to join) and
        register its prompt as a running prefill; ``p`` with that
        :class:`~gateway.local.dispatch.Dispatch`, which :meth:`release` gives back."""
        if p.dispatch is not None:
            return p
        call = p.call
        key = _session_key(call)
        home = self.turns.replica(key)
        new = key is not None and home is None  # a new session: its lease is to be placed
        size = self.turns.lease_blocks(call.who.tenant) if new else None
        d = await self.route(p.greq, call.route, call.trace, home, size)
        try:
            kv = self.dispatcher.kv
            if self.governor is not None and kv is not None and d.hashes and p.anchor:
                self.governor.observe(d.replica_id, d.hashes, p.anchor // kv.block_size)
            return dataclasses.replace(p, dispatch=d)
        except BaseException:
            self.dispatcher.release(d)
            raise

    def release(self, p: LocalPrepared) -> None:
        """Give back the prefill registration routing made (nothing once its first token
        came, or before it was routed)."""
        if p.dispatch is not None:
            self.dispatcher.release(p.dispatch)

    def send(self, p: LocalPrepared, session: str | None) -> Pieces:
        d = p.routed
        as_stop = p.ceiling and self.ceiling_finish == "stop"
        steps: list[Step] = []  # what each piece goes through, in the one generator
        if p.plan is not None:
            steps.append(p.plan.reader())
        elif json_answer(p.greq):
            steps.append(JsonText())
        if p.ends:
            owner = f"breakpoints:{p.call.who.tenant}:{session or p.call.request_id}"
            kv = self.dispatcher.kv
            block = kv.block_size if kv is not None else self.engine.capabilities.block_size
            steps.append(Retained(d, p.ends, owner, kv, block, self.leases))
        key = _session_key(p.call) or (f"{p.call.who.tenant}:log:{session}" if session else None)
        if key is not None and not p.call.warm:  # a warm's blocks are not a session's turn
            self.turns.began(key, p.call.who.tenant)
            steps.append(Paused(self.turns, self.dispatcher.kv, key, d.replica.id, d.hashes))
        return self.pieces(p.greq, d, "chat", p.t0, p.call.trace, as_stop, steps)

    def retry(self, p: LocalPrepared, error: Exception) -> LocalPrepared | None:
        return None  # another replica is the router's choice, made before the send

    def settle(self, p: LocalPrepared, usage: Usage) -> None:
        """Nothing left: the prediction was folded when vLLM reported its cached tokens
        (:meth:`Dispatcher.run`), and the KV events fold the blocks it stored."""

    async def _expanded(self, req: ChatCompletionRequest, ids: list[int]) -> VisionPrompt | None:
        """``ids`` with the request's images expanded (:func:`expanded_prompt`)."""
        return await expanded_prompt(req, ids, self.vision, self._prompts, self.engine.tokenizer)

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

    async def route(
        self,
        greq: GenerateRequest,
        route: RouteOverride | None,
        trace: RequestTrace,
        session: LocationId | None = None,
        lease_blocks: int | None = None,
    ) -> Dispatch:
        with trace.step("route") as span:
            lora, among = greq.lora, set[LocationId]()
            if lora is not None and self.adapters is not None:
                among = self.adapters.candidates(lora, greq)  # see adapter_placement
            d = await self.dispatcher.route(greq, route, session, lease_blocks, among)
            if lora is not None and self.adapters is not None:
                try:  # loaded there first (once, however many wait for it)
                    await self.adapters.ensure(d.replica, lora)
                except BaseException:
                    self.dispatcher.release(d)
                    raise
                span.set_attribute("vcache.adapter", lora.name)
            span.set_attribute("vcache.replica", d.replica_id)
            if d.predicted_cached_tokens is not None:
                span.set_attribute("vcache.predicted_cached_tokens", d.predicted_cached_tokens)
        return d

    async def pieces(
        self,
        greq: GenerateRequest,
        d: Dispatch,
        endpoint: str,
        t0: float,
        trace: RequestTrace,
        length_as_stop: bool = False,
        steps: Sequence[Step] = (),
    ) -> Pieces:
        """The engine's outputs as answer pieces, each through ``steps`` (tool calls,
        JSON text, breakpoints, a session's pause: plain calls, this one generator);
        ``length_as_stop``: an answer the operator's ceiling cut ends as the model's own
        end would."""
        first = True
        started: set[int] = set()  # the samples whose first piece went out
        async with aclosing(self.dispatcher.run(greq, d, endpoint, t0, trace)) as outputs:
            async for c in outputs:
                if isinstance(c, Totals):  # the last: the answer's usage
                    yield await ended(Piece(usage=c.usage()), steps)
                    continue
                head, first = first, False  # the first: what the engine knew at the start
                new = c.index not in started
                started.add(c.index)
                finish = c.finish_reason
                if length_as_stop and finish == "length":
                    finish = "stop"
                p = Piece(
                    c.text,
                    finish,
                    index=c.index,
                    logprobs=c.logprobs,
                    stop_sequence=c.stop_sequence,
                    token_ids=c.token_ids,
                    prompt_tokens=c.num_prompt_tokens if head else None,  # known at the first
                    cached_tokens=c.num_cached_tokens if head else None,
                    prompt_token_ids=greq.prompt_token_ids if new else None,
                    prompt_logprobs=c.prompt_logprobs,
                )
                if not steps:
                    yield p
                    continue
                for q in stepped(p, steps):
                    yield q

    # ---------------------------------------------------------- limits

    def engine_request(
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
        prompt_logprobs: int | None = None,
    ) -> GenerateRequest:
        room = Room(
            self.engine.capabilities.max_model_len, self._vocab(), clamp, self.max_output_tokens
        )
        pace = self.pace() if req.stream and self.output_interval_s > 0 else None
        greq = generate_request(
            rid,
            ids,
            req,
            limit,
            params,
            who,
            room,
            logprobs,
            structured,
            top_k,
            prompt_logprobs,
            pace,
        )
        lora = self.adapter(req.model)  # the adapter the model names runs on the base model
        return greq if lora is None else dataclasses.replace(greq, lora=lora)

    def pace(self) -> Pace:
        """The serving replicas' pace now: the slowest one's gap between tokens (the
        fewest tokens an interval: a streamed answer may be routed to any of them)."""
        gap = slowest(r.engine.stats().token_gap_s for r in self.dispatcher.serving())
        return Pace(gap, self.output_interval_s)


def _session_key(call: Call) -> str | None:
    """A named session (a header, an agent's own id, a previous response), per tenant."""
    return f"{call.who.tenant}:{call.session}" if call.session else None
