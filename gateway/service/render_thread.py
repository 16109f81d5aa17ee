"""Rendering and tokenizing: off the event loop where it is long, on it where it is short.

A coding agent's 50k-token prompt takes 100-250 ms to render through the chat
template and tokenize; on the event loop every other request would wait it
out (first tokens, streams, the engines' outputs).  vLLM's own server
tokenizes off its loop too.  One thread renders, in the order asked, with a
copy of the model's tokenizer of its own: a Hugging Face fast tokenizer is
not safe to use from two threads at once ("Already borrowed",
huggingface/tokenizers#537), and the loop keeps the original (tool-call
parsing, decoding).

Handing a job to the thread costs the request ~2.6 ms p50 of latency (the
loop's wakeups on a busy 2-core host), more than a short render's own work
now that what prompts repeat is tokenized once
(:mod:`engines.token_segments`): tokenizing afresh costs ~0.3 µs a character
on the demo tokenizer, 4,096 characters ~1.3 ms (docs/benchmarks.md).  So a
job whose caller bounds the characters it may tokenize afresh at
``inline_chars`` or fewer runs on the loop, and only while the thread is idle:
then nothing else uses the thread's tokenizer copy, or the memories the jobs
keep, and the job runs on the loop with them (the loop submits nothing while
it runs).  Any other job (longer, not bounded, or the thread busy) runs on the
thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from engines.tokenizer import ChatTokenizer

T = TypeVar("T")

THREAD_NAME = "vcache-render"
# a bound for the characters a job may tokenize afresh and still run on the loop where
# that is set (engine.render_inline_chars; off by default): ~1.3 ms on this host's demo
# tokenizer, half what the hop to the thread costs (docs/benchmarks.md)
INLINE_CHARS = 4096

Fresh = Callable[[], int | None]


class RenderThread:
    """Runs jobs that need the tokenizer on one thread of their own, one at a time, or on
    the loop when they are short and the thread idle."""

    def __init__(self, inline_chars: int = 0) -> None:
        """``inline_chars``: the most characters a job run on the loop may tokenize afresh
        (0: every job that tokenizes anything on the thread)."""
        self._pool: ThreadPoolExecutor | None = None
        self._source: ChatTokenizer | None = None
        self._copy: ChatTokenizer | None = None
        self._inline = inline_chars
        self._jobs: list[Future[Any]] = []  # submitted to the thread, maybe not done
        self.inline_runs = 0
        self.thread_runs = 0

    async def run(
        self, tok: ChatTokenizer, job: Callable[[ChatTokenizer], T], fresh: Fresh | None = None
    ) -> T:
        """``job(copy)``, ``copy`` being the render thread's own copy of ``tok`` (made here,
        on the loop, when ``tok`` is new: no two threads use one).  On the loop when the
        thread is idle and ``fresh()`` (asked then, so it may read what the jobs
        remember) bounds the characters the job may tokenize afresh at ``inline_chars``;
        else (``fresh`` None or saying None: not bounded) on the thread."""
        if self._source is not tok:
            self._source, self._copy = tok, tok.clone()
        own = self._copy
        assert own is not None
        if fresh is not None and self.idle():
            n = fresh()
            if n is not None and n <= self._inline:
                self.inline_runs += 1
                return job(own)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)
        done = self._pool.submit(job, own)
        self._jobs.append(done)
        self.thread_runs += 1
        return await asyncio.wrap_future(done)

    def idle(self) -> bool:
        """No job on the thread or waiting for it (a job is done once it has returned)."""
        self._jobs = [j for j in self._jobs if not j.done()]
        return not self._jobs

    def close(self) -> None:
        """Stop the thread: a job running finishes, queued ones are dropped (a later
        :meth:`run` starts it again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._jobs = []
