"""A request as the local engine takes it: checked against the model's context and
vocabulary as vLLM checks it, sampling options from the API's fields, the tenant's
cache salt and the request's priority."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engines.base import Engine, GenerateRequest, SamplingOptions, Structured
from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import InvalidRequest
from gateway.core.schemas import SamplingFields
from gateway.core.target import Sent
from gateway.core.types import ENGINE_PRIORITY, Principal, request_salt
from gateway.local.coalesce import Pace
from gateway.sessions.render import vllm_payload


@dataclass(frozen=True)
class Room:
    """What the model leaves a request: its context length, its vocabulary, whether an
    output limit past the context is clamped (agents ask for more than fits), and the
    most tokens one answer may generate (the operator's ceiling, ``engine.max_output_tokens``)."""

    max_len: int
    vocab: int
    clamp: bool = False
    max_output: int | None = None


def sent_to_engine(g: GenerateRequest, rendered: Mapping[str, Any]) -> Sent:
    """What the journal keeps of a request handed to vLLM: the payload's bytes, and the
    directives that rebuild them: the salt, the resolved sampling and ``rendered`` (how
    the prompt became its ids: a chat's ``template``, a text's ``prompt``); the adapter
    it runs under is in the payload, as its header snapshot keeps it."""
    sampling = sampling_record(g.sampling)
    images = [hashlib.sha256(im.data).hexdigest() for im in g.images]
    uuids = [im.uuid for im in g.images]
    body = vllm_payload(g.prompt_token_ids, g.cache_salt, sampling, images, g.lora, uuids)
    directives = {"cache_salt": g.cache_salt, "sampling": sampling, **rendered}
    return Sent(g.request_id, LOCAL_TARGET, "vllm", directives, body)


_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingOptions))


def sampling_record(s: SamplingOptions) -> dict[str, Any]:
    """``dataclasses.asdict(s)``, equal to it, in a few µs instead of ~80: every field is
    a scalar or a tuple of them (kept as they are: immutable, as asdict's copies are),
    the structured-output constraint a dataclass of them (its dict, when there is one)."""
    out = {name: getattr(s, name) for name in _SAMPLING_FIELDS}
    if s.structured is not None:
        out["structured"] = dataclasses.asdict(s.structured)
    return out


def vocab_size(engine: Engine) -> int:
    """The larger of the tokenizer's and the model's vocabulary, as vLLM's own check."""
    return max(engine.tokenizer.vocab_size, engine.capabilities.vocab_size or 0)


def check_token_ids(ids: list[int], param: str, vocab: int) -> list[int]:
    """Client-given token ids, each inside the vocabulary (else a 400 naming it)."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InvalidRequest(
                f"Invalid value for '{param}[{i}]': token id {t} is out of vocabulary "
                f"(the model's {vocab} ids are 0 to {vocab - 1})",
                param=f"{param}[{i}]",
                code="invalid_value",
            )
    return ids


def logit_bias(req: SamplingFields, vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` checked against the vocabulary, as vLLM checks it."""
    bias = req.bias()
    for t, _ in bias:
        if t >= vocab:
            raise InvalidRequest(
                f"Invalid value for 'logit_bias': token id {t} is out of vocabulary "
                f"(the model's {vocab} ids are 0 to {vocab - 1})",
                param="logit_bias",
                code="invalid_value",
            )
    return bias


def generate_request(
    rid: str,
    ids: list[int],
    req: SamplingFields,
    limit: int | None,
    params: tuple[str, str],
    who: Principal,
    room: Room,
    logprobs: int | None = None,
    structured: Structured | None = None,
    top_k: int | None = None,
    prompt_logprobs: int | None = None,
    pace: Pace | None = None,
) -> GenerateRequest:
    """``ids`` and the request's sampling fields as the engine's request; a prompt or an
    output limit that does not fit the context is a 400 naming ``params`` (prompt, limit).
    ``pace``: the engine's, by which a streamed answer's outputs are coalesced (None: not)."""
    prompt_param, limit_param = params
    max_len = room.max_len
    if len(ids) >= max_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_len} tokens; "
            f"the prompt has {len(ids)} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    left = max_len - len(ids)
    if room.clamp and limit is not None:
        limit = min(limit, left)
    if limit is not None and limit > left:
        raise InvalidRequest(
            f"max_tokens is {limit}, but the prompt has {len(ids)} tokens and the "
            f"model's maximum context length is {max_len}: at most {left} can be generated",
            param=limit_param,
            code="context_length_exceeded",
        )
    max_tokens = left if limit is None else limit
    if room.max_output is not None:
        max_tokens = min(max_tokens, room.max_output)
    if req.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {req.min_tokens}",
            param="min_tokens",
            code="invalid_value",
        )
    if req.structured_outputs is not None:
        if structured is not None:  # from response_format, or a tool_choice that forces
            raise InvalidRequest(
                "structured_outputs cannot be combined with response_format or a "
                "tool_choice that forces a call (each constrains the output)",
                param="structured_outputs",
                code="invalid_value",
            )
        structured = req.structured_outputs.structured()
    allowed = req.allowed_token_ids
    if allowed is not None:
        check_token_ids(allowed, "allowed_token_ids", room.vocab)
    sampling = SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or top_k or 0, 0),  # vLLM's -1 is its 0: no limit
        stop=req.stop_list(),
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        ignore_eos=req.ignore_eos,
        n=req.n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
        logit_bias=logit_bias(req, room.vocab),
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=req.min_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        bad_words=tuple(req.bad_words or ()),
        allowed_token_ids=tuple(allowed) if allowed is not None else None,
        # an answer sent whole needs no output per step: the engine sends the first
        # token (the prefill is done) and the last, and nothing relays the rest one by
        # one; a streamed one, one every so many tokens where the engine makes several
        # an output interval (gateway/local/coalesce.py)
        stream_interval=(
            (pace.every(max_tokens) if pace is not None else None)
            if req.stream
            else max(max_tokens, 1)
        ),
    )
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=tuple(ids),
        sampling=sampling,
        cache_salt=request_salt(who.tenant, req.cache_salt),
        tenant=who.tenant,
        priority=ENGINE_PRIORITY[who.priority],
    )
