"""An in-memory engine for unit tests: deterministic, instant, observable.

It models a block-granular prefix cache (full blocks of a prompt are cached
after the prompt has been seen, keyed by the salt and every token before and
in the block) so cached-token accounting can be tested without vLLM.

A test that orders events around a request in flight (a prompt still in
prefill, a stream under way) holds its tokens with a :class:`Hold` rather
than pacing them with ``step_delay_s`` and sleeping: the request waits at a
token until the test lets it go, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Collection

from engines.base import (
    CoreTimes,
    EngineCapabilities,
    EngineStats,
    GenerateChunk,
    GenerateRequest,
    TokenLogprob,
)
from engines.errors import EngineInputError, EngineOverloaded, EngineUnavailable
from engines.tokenizer import ChatTokenizer


class Hold:
    """Holds a fake engine's requests before one of their tokens until the test lets
    them go.

    A held request produces its first ``at`` tokens, then waits before token ``at``
    (``at=0``: still in prefill; ``at=1``: its stream under way) until :meth:`release`.
    ``only`` names the request ids held (default: every request).  :meth:`waiting`
    says whether a request's latest attempt waits at the hold now (a request stopped
    and started over waits again), so a test on the engine's loop awaits that fact
    instead of sleeping.  :meth:`release` may be called from another thread (a test
    driving the app through ``TestClient``, which runs it on a loop of its own).  A
    held request that is cancelled (aborted, the client gone) stops waiting like any
    other.
    """

    def __init__(self, at: int = 0, only: Collection[str] | None = None) -> None:
        self.at = at
        self._only = None if only is None else frozenset(only)
        self._lock = threading.Lock()
        self._released: set[str] = set()
        self._all = False
        # request id -> (its loop, the event its waiting attempt awaits)
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}

    def _holds(self, request_id: str) -> bool:
        held = self._only is None or request_id in self._only
        return held and not self._all and request_id not in self._released

    def waiting(self, request_id: str) -> bool:
        """Whether ``request_id``'s latest attempt waits at the hold now."""
        with self._lock:
            return request_id in self._waiting

    async def __call__(self, request_id: str, index: int) -> None:
        """Awaited by the engine before token ``index`` of ``request_id``."""
        if index != self.at:
            return
        gate = asyncio.Event()
        with self._lock:
            if not self._holds(request_id):
                return
            self._waiting[request_id] = (asyncio.get_running_loop(), gate)
        try:
            await gate.wait()
        finally:
            with self._lock:
                if self._waiting.get(request_id, (None, None))[1] is gate:
                    del self._waiting[request_id]

    def release(self, request_id: str | None = None) -> None:
        """Let ``request_id`` go on (this attempt and any later one), or every request
        (None: now and from now on)."""
        with self._lock:
            if request_id is None:
                self._all = True
                gates = list(self._waiting.values())
            else:
                self._released.add(request_id)
                gates = [self._waiting[request_id]] if request_id in self._waiting else []
        for loop, gate in gates:
            loop.call_soon_threadsafe(gate.set)


class FakeEngine:
    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        block_size: int = 16,
        max_model_len: int = 2048,
        max_queued_requests: int | None = None,
        step_delay_s: float = 0.0,
        reply: str = "hello from the fake engine",
        structured_reply: str = '{"answer": "fake"}',  # what it writes under a constraint
        vocab_size: int | None = None,
        hold: Hold | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._caps = EngineCapabilities(
            name="fake",
            max_model_len=max_model_len,
            block_size=block_size,
            exact_prefix_cache=True,
            vocab_size=vocab_size,
        )
        self._max_queued = max_queued_requests
        self._delay = step_delay_s
        self._hold = hold
        self._reply_ids = tokenizer.encode(reply)
        self._structured_ids = tokenizer.encode(structured_reply)
        self._cached: set[tuple[str | None, tuple[int, ...]]] = set()
        self._running: set[str] = set()
        self._started = False
        self._closed = False
        self._dead = False
        self.aborted: list[str] = []
        self.received: list[GenerateRequest] = []

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    @property
    def ready(self) -> bool:
        return self._started and not self._closed and not self._dead

    def kill(self) -> None:
        """Die as an engine whose process exited: not ready, every call refused."""
        self._dead = True

    async def start(self) -> None:
        if self._started:
            raise EngineUnavailable("already started")
        self._started = True

    def stats(self) -> EngineStats:
        n = len(self._running)
        return EngineStats(unfinished_requests=n, core_running_requests=n)

    def _cached_tokens(self, req: GenerateRequest) -> int:
        bs = self._caps.block_size
        ids = req.prompt_token_ids
        n = 0
        # vLLM never serves the whole prompt from cache: the last token is recomputed.
        while n + bs <= len(ids) - 1 and (req.cache_salt, ids[: n + bs]) in self._cached:
            n += bs
        for end in range(bs, len(ids) + 1, bs):
            self._cached.add((req.cache_salt, ids[:end]))
        return n

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        if not self.ready:
            raise EngineUnavailable("engine is not ready")
        if request.num_prompt_tokens + 1 > self._caps.max_model_len:
            raise EngineInputError("prompt too long", param="messages")
        if self._max_queued is not None and len(self._running) >= self._max_queued:
            raise EngineOverloaded("queue full", retry_after_s=1.0)
        self.received.append(request)
        self._running.add(request.request_id)
        finished = False
        queued = time.monotonic()  # scheduled at once: the fake has no queue
        try:
            cached = self._cached_tokens(request)
            s = request.sampling
            if s.structured is not None:  # one JSON object, then stop
                ids = self._structured_ids[: s.max_tokens]
                end = "stop" if len(ids) == len(self._structured_ids) else "length"
            else:
                reply = self._reply_ids
                ids, end = (reply * (s.max_tokens // len(reply) + 1))[: s.max_tokens], "length"
            every = s.stream_interval or 1  # as vLLM: the first, every this many, the last
            held: list[int] = []
            for i, tok in enumerate(ids):
                if self._hold is not None:
                    await self._hold(request.request_id, i)
                await asyncio.sleep(self._delay)
                last = i == len(ids) - 1
                held.append(tok)
                if not (i == 0 or last or len(held) >= every):
                    continue
                for index in range(s.n):  # the samples step together
                    yield GenerateChunk(
                        text="".join(self._tokenizer.decode([t]) for t in held),
                        token_ids=tuple(held),
                        num_prompt_tokens=request.num_prompt_tokens,
                        num_cached_tokens=cached,
                        finish_reason=end if last else None,
                        index=index,
                        logprobs=tuple(
                            lp for t in held for lp in self._logprobs(t, index, s.logprobs)
                        ),
                        prompt_logprobs=self._prompt_logprobs(request) if i == 0 else None,
                        core_times=(
                            CoreTimes(queued, queued, time.monotonic()) if i == 0 else None
                        ),
                    )
                held = []
            if not ids:
                yield GenerateChunk("", (), request.num_prompt_tokens, cached, "length")
            finished = True
        finally:
            self._running.discard(request.request_id)
            if not finished:
                self.aborted.append(request.request_id)

    def _logprobs(self, tok: int, index: int, top: int | None) -> tuple[TokenLogprob, ...]:
        """Made-up but well-formed: the sampled token first, then ``top - 1`` others."""
        if top is None:
            return ()
        text = self._tokenizer.decode([tok])
        lp = -0.25 * (index + 1)
        others = tuple((f"alt{k}", lp - k) for k in range(1, top))
        ids = (tok, *range(1, top))[:top]
        return (TokenLogprob(text, lp, ((text, lp), *others)[:top], tok, ids, 1),)

    def _prompt_logprobs(self, request: GenerateRequest) -> tuple[TokenLogprob | None, ...] | None:
        """Made-up but well-formed, as vLLM's: none for the first token, then each token
        (rank 2, -1.5) after the ``top`` best (token id k, -0.5 k)."""
        top = request.sampling.prompt_logprobs
        if top is None:
            return None
        best = tuple((self._tokenizer.decode([k]), -0.5 * k) for k in range(1, top + 1))
        ids = tuple(range(1, top + 1))
        rest = request.prompt_token_ids[1:]
        return (
            None,
            *(TokenLogprob(self._tokenizer.decode([t]), -1.5, best, t, ids, 2) for t in rest),
        )

    async def close(self) -> None:
        self._closed = True
