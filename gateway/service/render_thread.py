"""Rendering and tokenizing off the event loop.

A coding agent's 50k-token prompt takes 100-250 ms to render through the chat
template and tokenize; on the event loop every other request would wait it
out (first tokens, streams, the engines' outputs).  vLLM's own server
tokenizes off its loop too.  One thread renders, in the order asked, with a
copy of the model's tokenizer of its own: a Hugging Face fast tokenizer is
not safe to use from two threads at once ("Already borrowed",
huggingface/tokenizers#537), and the loop keeps the original (tool-call
parsing, decoding).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engines.tokenizer import ChatTokenizer

T = TypeVar("T")

THREAD_NAME = "vcache-render"


class RenderThread:
    """Runs jobs that need the tokenizer on one thread of their own, one at a time."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._source: ChatTokenizer | None = None
        self._copy: ChatTokenizer | None = None

    async def run(self, tok: ChatTokenizer, job: Callable[[ChatTokenizer], T]) -> T:
        """``job(copy)`` on the render thread, ``copy`` being the thread's own copy of
        ``tok`` (made here, on the loop, when ``tok`` is new: no two threads use one)."""
        if self._source is not tok:
            self._source, self._copy = tok, tok.clone()
        own = self._copy
        assert own is not None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)
        return await asyncio.get_running_loop().run_in_executor(self._pool, job, own)

    def close(self) -> None:
        """Stop the thread: a job running finishes, queued ones are dropped (a later
        :meth:`run` starts it again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
