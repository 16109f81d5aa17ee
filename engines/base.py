"""The one small interface every generating engine implements.

The gateway always hands an engine *token ids*, never text: it tokenizes with
the model's own tokenizer and chat template, so it knows exactly which tokens
an engine may have cached.  Lifecycle: ``start()`` once, then any number of
``generate()`` streams, then ``close()``; ``generate`` before ``start`` or
after ``close`` raises :class:`~engines.errors.EngineUnavailable`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.lora import LoraRef
from engines.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class Structured:
    """Constrain the output (vLLM structured outputs): one of a JSON schema (canonical JSON
    text), any JSON object, a regex, a choice of strings, a grammar (EBNF/Lark/GBNF) or a
    structural tag (JSON text); JSON allows no free whitespace unless ``any_whitespace``."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    any_whitespace: bool = False
    whitespace_pattern: str | None = None
    no_additional_properties: bool = False

    def vllm(self) -> dict[str, Any]:
        """As vLLM's ``structured_outputs`` (its StructuredOutputsParams fields)."""
        kind: dict[str, Any]
        if self.json_schema is not None:
            kind = {"json": self.json_schema}
        elif self.regex is not None:
            kind = {"regex": self.regex}
        elif self.choice is not None:
            kind = {"choice": list(self.choice)}
        elif self.grammar is not None:
            kind = {"grammar": self.grammar}
        elif self.structural_tag is not None:
            kind = {"structural_tag": self.structural_tag}
        else:
            kind = {"json_object": True}
        kind["disable_any_whitespace"] = not self.any_whitespace
        if self.whitespace_pattern is not None:
            kind["whitespace_pattern"] = self.whitespace_pattern
        if self.no_additional_properties:
            kind["disable_additional_properties"] = True
        return kind


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token may be sampled
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    n: int = 1  # parallel samples of one prompt (its KV computed once)
    logprobs: int | None = None  # the sampled token's logprob and this many top ones
    prompt_logprobs: int | None = None  # each prompt token's, and this many top ones
    structured: Structured | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # vLLM's own sampling extensions (their defaults mean "not asked")
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    # outputs coalesced: the first token, then every this many, and the last (vLLM's
    # stream_interval); None: every step's.  For an answer the client takes whole.
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.n < 1:
            raise ValueError("n must be >= 1")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether vLLM reads cached blocks for a request sampled so: not when it asks
        for prompt logprobs (``SamplingParams.skip_reading_prefix_cache`` defaults to
        that: a cached token has no logprob), though it still stores its blocks."""
        return self.prompt_logprobs is None


@dataclass(frozen=True)
class EngineImage:
    """An image of a prompt as the engine takes it: the client's original bytes (the
    engine's identifier is blake3 over them) and, when the client named the image, its
    uuid (then the identifier); ``offset`` and ``length``: where its placeholder tokens
    sit in the expanded prompt (vLLM's ``PlaceholderRange``)."""

    data: bytes = field(repr=False)
    media_type: str
    identifier: str  # the gateway's (gateway/local/vision_prompt.py): equals the engine's
    uuid: str | None = None
    offset: int = 0
    length: int = 0


@dataclass(frozen=True)
class RequestHold:
    """A hold carried in its request (gateway/local/kv_holds.py): the engine core keeps
    the leading resident blocks of ``hashes`` (the prompt's full blocks, in order) from
    eviction from the moment it queues the request until it schedules it, all or
    nothing, refused past ``max_share`` of its KV blocks held or with fewer than
    ``reserve`` blocks left free, and for at most ``ttl_s``.  Its answer comes on the
    request's first chunk (:attr:`GenerateChunk.hold`)."""

    hashes: tuple[bytes, ...]
    max_share: float
    reserve: int
    ttl_s: float


@dataclass(frozen=True)
class GenerateRequest:
    """``prompt_token_ids`` are the prompt as the engine caches it (an image expanded to
    its placeholder tokens: what admission, hashing and prediction count).  With images,
    the engine is given ``template_token_ids`` instead (one image token per image, in
    prompt order) and expands them itself: given expanded ids it would expand them
    again."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = field(repr=False)
    sampling: SamplingOptions
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: lower is served first (under its "priority" scheduling)
    tenant: str | None = None  # whose request (admission fairness); None: the cache salt's
    lora: LoraRef | None = None  # the adapter it runs under (None: the base model)
    images: tuple[EngineImage, ...] = ()
    template_token_ids: tuple[int, ...] | None = field(default=None, repr=False)
    # a hold on its leading resident blocks, taken by the engine core as it queues the
    # request (an engine whose ``holds_in_request`` is true; others ignore it)
    hold: RequestHold | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.images and self.template_token_ids is None:
            raise ValueError("a request with images needs the template's token ids")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


LOGPROB_FLOOR = -9999.0  # what vLLM's own server sends for -inf (JSON has no infinity)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability, and the most likely tokens at its step."""

    token: str
    logprob: float | None  # None: a prompt's first token (nothing before it to score it)
    top: tuple[tuple[str, float], ...] = ()  # best first
    token_id: int | None = None
    top_ids: tuple[int, ...] = ()  # the ids of ``top``, where the engine gives them
    rank: int | None = None  # the token's rank among the vocabulary at its step


@dataclass(frozen=True)
class CoreTimes:
    """When the engine core queued a request, scheduled it and produced its first token
    (its own ``time.monotonic()``: on Linux one clock for every process of a host)."""

    queued_s: float
    scheduled_s: float
    first_token_s: float


@dataclass(frozen=True)
class GenerateChunk:
    """One step of a generation stream: the *new* text and tokens only, of one sample."""

    text: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int | None  # prompt tokens served from cache; None: not reported yet
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the sample's last chunk
    index: int = 0  # which of the ``n`` samples
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked for
    core_times: CoreTimes | None = None  # first chunk, an engine core on this host
    stop_sequence: str | None = None  # the stop string that ended the sample, when one did
    # first chunk, where asked: each prompt token's logprob (None for the first token)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # first chunk, the answer to the hold its request carried: (leading blocks held, why
    # none were: "" or "budget", "reserve", ...); None: no hold asked, or no answer
    hold: tuple[int, str] | None = None


@dataclass(frozen=True)
class EngineCapabilities:
    """What a target offers, as data (the planner reads it, never branches on a class)."""

    name: str
    max_model_len: int
    block_size: int
    exact_prefix_cache: bool
    hash_algo: str | None = None
    hash_seed: str | None = None
    vocab_size: int | None = None  # the model's (embedding rows); None: the tokenizer's
    span_control: bool = False  # its core runs the vcache plugin: pin/evict/inspect by hash
    model: str | None = None  # what it loaded: a local path or hub id (its tokenizer's too)


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time view of what the engine holds, for metrics and tests."""

    unfinished_requests: int = 0  # held by the frontend (waiting for output)
    core_running_requests: int = 0  # as the engine core's scheduler last reported
    core_waiting_requests: int = 0
    kv_cache_usage: float = 0.0  # share of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up, cumulative
    prefix_cache_hits: int = 0  # of those, found in the cache
    # image requests a remote replica expanded to other token ids than the gateway's
    # (their predictions may be wrong), cumulative
    image_expansion_mismatches: int = 0
    # a running request's gap between two tokens as the engine core makes them (a moving
    # average over its steps), in seconds; None: not measured (a remote replica, a fake)
    token_gap_s: float | None = None


class Engine(Protocol):
    @property
    def capabilities(self) -> EngineCapabilities: ...

    @property
    def tokenizer(self) -> ChatTokenizer: ...

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None:
        """Load the model; after it returns ``ready`` is true.  Not idempotent."""

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        """Stream chunks; closing or cancelling the iterator aborts the request."""
        ...

    def stats(self) -> EngineStats:
        """What the engine holds now; cheap, never blocks."""
        ...

    async def close(self) -> None:
        """Abort what is running and release the engine.  Idempotent."""


def call_id() -> str:
    """An id for a tool call the model made without one (OpenAI's ``call_`` form)."""
    return f"call_{uuid.uuid4().hex[:24]}"
