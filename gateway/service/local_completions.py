"""Text completions on the local model (``POST /v1/completions``): one engine request
per prompt, routed and predicted each, generated together (completions.py merges
them); echo, the prompt's logprobs and vLLM's token-id fields as asked."""

from __future__ import annotations

import time
from contextlib import aclosing

from engines.base import GenerateRequest
from gateway.core.completion_request import CompletionRequest
from gateway.core.errors import InvalidRequest
from gateway.core.shaping import Pieces
from gateway.core.tracing import RequestTrace
from gateway.core.types import Principal, RouteOverride, Served
from gateway.service.completions import Echo, Prompt, echoed, merged, prompt_list
from gateway.service.json_text import escaped_json, json_answer
from gateway.service.local import LocalChat
from gateway.sessions.render import truncated

COMPLETION_MAX_TOKENS = 16  # text completions without max_tokens, as OpenAI's and vLLM's


class LocalCompletions:
    def __init__(self, local: LocalChat) -> None:
        self.local = local

    def _request(
        self, req: CompletionRequest, who: Principal, rid: str, prompt: Prompt, param: str
    ) -> GenerateRequest:
        local = self.local
        local.check_ready()
        engine = local.engine
        if isinstance(prompt, str):
            ids = engine.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = local.check_token_ids(prompt, param)
        keep = req.prompt_keep(engine.capabilities.max_model_len)
        ids = truncated(ids, keep, req.truncation_side)
        if not ids:
            raise InvalidRequest("prompt must not be empty", param=param, code="invalid_value")
        limit = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        return local.engine_request(
            rid,
            ids,
            req,
            max(limit, 1),  # 0 (with echo): one token generated, none answered, as vLLM
            (param, "max_tokens"),
            who,
            logprobs=req.logprobs,
            clamp=req.max_tokens is None,  # the default fits what the context leaves
            prompt_logprobs=req.prompt_logprobs_asked(),
        )

    async def pieces(
        self,
        req: CompletionRequest,
        who: Principal,
        route: RouteOverride | None,
        served: Served,
        rid: str,
        trace: RequestTrace,
    ) -> Pieces:
        """One engine request per prompt (see completions.py), generated together."""
        local = self.local
        with local.dispatcher.admit(who.priority):
            t0 = time.perf_counter()
            prompts = prompt_list(req)
            with trace.step("tokenize"):
                greqs = [
                    self._request(req, who, f"{rid}-{i}" if i else rid, p, param)
                    for i, (p, param) in enumerate(prompts)
                ]
            streams = []
            for greq in greqs:
                d = await local.route(greq, route, trace)
                served.dispatch = served.dispatch or d  # the headers name the first's
                pieces = local.pieces(greq, d, "completions", t0, trace)
                streams.append(escaped_json(pieces) if json_answer(greq) else pieces)
            pieces = streams[0] if len(streams) == 1 else merged(streams, req.n)
            ids = [g.prompt_token_ids for g in greqs]
            if req.echo:
                decode = local.engine.tokenizer.decode
                echo = Echo(  # token prompts echoed with their special tokens, as vLLM's
                    texts=[p if isinstance(p, str) else decode(p, False) for p, _ in prompts],
                    ids=ids,
                    decode=decode,
                    logprobs=req.logprobs is not None,
                    generated=req.max_tokens != 0,
                )
                pieces = echoed(pieces, echo, req.n)
            async with aclosing(pieces):
                async for piece in pieces:
                    yield piece
