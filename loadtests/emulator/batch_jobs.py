"""Running a batch job: its items answered as the online endpoint would, in waves.

A job runs once its ``delay_s`` (emulator time, :class:`~.batch_book.BatchRules`) has
passed since its creation, on the first read of it after that (no background task: a
test moves the clock and reads). Its items are answered in the order they were given,
``parallel`` at a time (each wave moving the clock on by ``wave_s``): the items of one
wave read the cache as the earlier waves left it and write their own prefixes only once
the wave is over, so a batch's caching is best effort, as the providers document it (a
batch sent in the order of its shared prefixes reads more of them than one in arrival
order). The cache is the provider's own (a batch reads what online requests wrote, and
the reverse); rate limits do not apply (a batch has its own queue), and the tokens are
billed on the provider's ``-batch`` bill (``openai-batch``, ``anthropic-batch``), priced
at :data:`~.batch_book.BATCH_DISCOUNT` of the online price.

An item's answer is the body the online endpoint would have sent (its usage, cache reads
and writes included) or the error body it would have answered with.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from . import anthropic as anth
from . import openai as oai
from .batch_book import Item, Job
from .common import answer_length, reply_words
from .media import BadMedia, Weigher
from .state import EmulatorState, PrefixStore, TokenStream, compact, implicit_lookup, tokens
from .thinking import problem as thinking_problem


class Deferred(PrefixStore):
    """A shard as one wave sees it: reads go to the shard, writes wait for the wave's end."""

    def __init__(self, state: EmulatorState, inner: PrefixStore, pending: list[Any]) -> None:
        super().__init__(state.clock, 0)
        self._inner = inner
        self._pending = pending

    def read(self, key: bytes) -> Any:
        return self._inner.read(key)

    def write(self, key: bytes, n_tokens: int, ttl_s: float) -> None:
        self._pending.append((self._inner, key, n_tokens, ttl_s))


def settle(state: EmulatorState, job: Job) -> None:
    """Bring ``job`` up to the emulator's clock (see the module)."""
    if job.ended:
        return
    if job.state == "cancelling":
        job.state, job.ended_at = "cancelled", int(time.time())
        return
    if state.clock.now() < job.created + state.batch_book.rules.delay_s:
        return
    run(state, job)
    job.state, job.ended_at = "completed", int(time.time())


def run(state: EmulatorState, job: Job) -> None:
    """Answer every item, in waves (see the module)."""
    rules = state.batch_book.rules
    step = max(1, rules.parallel)
    for start in range(0, len(job.items), step):
        pending: list[Any] = []
        for item in job.items[start : start + step]:
            answer(state, job, item, pending)
        for store, key, n, ttl in pending:
            store.write(key, n, ttl)
        if rules.wave_s:
            state.clock.advance(rules.wave_s)


def answer(state: EmulatorState, job: Job, item: Item, pending: list[Any]) -> None:
    try:
        if job.provider == "anthropic":
            item.status, item.answer = _anthropic(state, item.body, pending)
        elif job.endpoint == "/v1/responses":
            item.status, item.answer = _responses(state, item.body, pending)
        else:
            item.status, item.answer = _chat(state, item.body, pending)
    except (BadMedia, anth.BadRequest, KeyError, TypeError, AttributeError, ValueError) as exc:
        error = anth.error if job.provider == "anthropic" else oai.error
        item.status, item.answer = 400, error(400, str(exc) or "invalid request")


def _openai_cache(
    state: EmulatorState, body: dict[str, Any], stream: TokenStream, pending: list[Any]
) -> oai.Cached:
    """OpenAI's automatic caching (as ``openai._cache``) with the wave's writes deferred."""
    rules = oai.effective(state, oai.OPENAI)
    cuts = list(range(rules.minimum, stream.total + 1, rules.step))
    keys = stream.keys(str(body["model"]).encode() + b"\0", cuts)
    head = stream.data[: stream.byte_end(oai.ROUTE_TOKENS)]
    route = head + b"\0" + str(body.get("prompt_cache_key") or "").encode()
    shard = Deferred(state, state.store("openai").shard(route), pending)
    hit = implicit_lookup(shard, keys)
    ttl = rules.ttl_long_s if body.get("prompt_cache_retention") == "24h" else rules.ttl_s
    for cut, key in keys:
        shard.write(key, cut, ttl)
    return oai.Cached(stream.total, hit)


def _chat(state: EmulatorState, body: Any, pending: list[Any]) -> tuple[int, dict[str, Any]]:
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return 400, oai.error(400, "you must provide a model parameter")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return 400, oai.error(400, "messages: must be a non-empty array")
    if body.get("stream"):
        return 400, oai.error(400, "stream: streaming is not supported in a batch")
    bad = oai._unanswerable(msgs)
    if bad is not None:
        return 400, oai.error(400, bad)
    weigher = Weigher("openai")
    prompt = oai.chat_stream(body, weigher)
    state.media += weigher.seen
    c = _openai_cache(state, body, prompt, pending)
    raw = compact(body)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    n = answer_length(state, limit)
    uses = oai._tool_uses(body, raw)
    words = [] if uses else reply_words(raw, n)
    finish = "length" if limit is not None and n == int(limit) else "stop"
    message: dict[str, Any] = {"role": "assistant", "content": "".join(words)}
    if uses:
        finish = "tool_calls"
        message["content"] = None
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": u.name, "arguments": compact(u.args).decode()},
            }
            for u in uses
        ]
    out_tokens = len(words) + sum(tokens(compact(u.args)) for u in uses)
    state.bill("openai-batch").add(c.prompt - c.cached, c.cached, 0, 0, out_tokens)
    return 200, {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": oai._usage(oai.OPENAI, c, out_tokens),
    }


def _responses(state: EmulatorState, body: Any, pending: list[Any]) -> tuple[int, dict[str, Any]]:
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return 400, oai.error(400, "you must provide a model parameter")
    if not body.get("input"):
        return 400, oai.error(400, "input: required")
    weigher = Weigher("openai")
    prompt = oai.responses_stream(body, weigher)
    state.media += weigher.seen
    c = _openai_cache(state, body, prompt, pending)
    n = answer_length(state, body.get("max_output_tokens"))
    state.bill("openai-batch").add(c.prompt - c.cached, c.cached, 0, 0, n)
    text = "".join(reply_words(compact(body), n))
    return 200, oai.response_object(body["model"], text, c.prompt, c.cached, n)


def _anthropic(state: EmulatorState, body: Any, pending: list[Any]) -> tuple[int, dict[str, Any]]:
    body = anth._validate(body)
    if body.get("stream"):
        raise anth.BadRequest("stream: streaming is not supported in a batch")
    anth._check_results(body["messages"])
    refused = thinking_problem(body)
    if refused is not None:
        raise anth.BadRequest(refused)
    weigher = Weigher("anthropic")
    blocks = anth.blocks_of(body, weigher)
    state.media += weigher.seen
    store = Deferred(state, state.store("anthropic").shard(b""), pending)
    usage = anth.apply_cache(store, body["model"], blocks, state.rule("anthropic"))
    raw = compact(body)
    n = answer_length(state, body["max_tokens"])
    uses = anth._tool_uses(body, raw) if n else []
    words = [] if uses else reply_words(raw, n)
    stop = "tool_use" if uses else "max_tokens" if n == body["max_tokens"] else "end_turn"
    calls = [
        {
            "type": "tool_use",
            "id": f"toolu_{uuid.uuid4().hex[:24]}",
            "name": u.name,
            "input": u.args,
        }
        for u in uses
    ]
    output = len(words) + sum(tokens(compact(u.args)) for u in uses)
    state.bill("anthropic-batch").add(
        usage.input_tokens, usage.read, usage.write_5m, usage.write_1h, output
    )
    return 200, {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": ([{"type": "text", "text": "".join(words)}] if words else []) + calls,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {**usage.fields(), "output_tokens": output},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"
