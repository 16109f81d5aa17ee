"""Text completions as OpenAI defines them: several prompts in one request, and echo.

A request with k prompts and ``n`` samples answers k x n choices; prompt i's
sample j is choice ``i * n + j``.  Each prompt is its own engine request (its own
route and prediction), all generated at once; their pieces are merged as they
come and one usage, the sum, ends the answer.  With ``echo`` each choice's text
starts with its prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from engines.base import TokenLogprob
from gateway.core.completion_request import CompletionRequest
from gateway.core.outputs import Usage
from gateway.core.pieces import Piece, Pieces

Prompt = str | list[int]


def prompt_list(req: CompletionRequest) -> list[tuple[Prompt, str]]:
    """Each prompt of the request, with the parameter that names it in an error."""
    p = req.prompt
    if isinstance(p, str):
        return [(p, "prompt")]
    if p and isinstance(p[0], int):
        return [(list(p), "prompt")]
    return [(x, f"prompt[{i}]") for i, x in enumerate(p)]  # type: ignore[misc]


async def merged(streams: Sequence[Pieces], n: int) -> Pieces:
    """The pieces of every prompt's answer as they come, re-indexed (prompt i's sample j
    is choice ``i * n + j``), then one usage: the sum.  Closing it closes them all."""
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, pieces: Pieces) -> None:
        try:
            async with aclosing(pieces):
                async for p in pieces:
                    await queue.put((i, p))
        except Exception as exc:  # the first failure fails the whole answer
            await queue.put((i, exc))
        else:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    prompt = completion = cached = 0
    try:
        ended = 0
        while ended < len(tasks):
            i, item = await queue.get()
            if item is None:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            elif item.usage is not None:
                u = item.usage
                prompt += u.prompt_tokens
                completion += u.completion_tokens
                cached += u.prompt_tokens_details.cached_tokens
            else:  # a prompt's own counts are not the answer's: the usage sums them
                yield dataclasses.replace(
                    item, index=i * n + item.index, prompt_tokens=None, cached_tokens=None
                )
        yield Piece(usage=Usage.of(prompt, completion, cached))
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


@dataclass(frozen=True)
class Echo:
    """What an echoed answer starts with: each prompt's text, whether its tokens' logprobs
    lead the choice's (echo with logprobs; the prompt's ids are those its choice's first
    piece carries, as the engine took them), and whether anything generated follows
    (``max_tokens: 0`` scores the prompt only)."""

    texts: Sequence[str]
    decode: Callable[[Sequence[int]], str]
    logprobs: bool = False
    generated: bool = True


async def echoed(pieces: Pieces, echo: Echo, n: int) -> Pieces:
    """``pieces`` with each choice's text (and logprobs, where asked) starting with its
    prompt's."""
    started: set[int] = set()
    async with aclosing(pieces):
        async for p in pieces:
            if p.usage is not None:
                yield p
                continue
            if not echo.generated:
                p = dataclasses.replace(p, text="", logprobs=(), token_ids=())
            if p.index not in started:
                started.add(p.index)
                lps = p.logprobs
                if echo.logprobs and p.prompt_logprobs is not None:
                    ids = p.prompt_token_ids or ()
                    lps = (*_prompt_entries(echo, ids, p.prompt_logprobs), *lps)
                p = dataclasses.replace(p, text=echo.texts[p.index // n] + p.text, logprobs=lps)
            yield p


def _prompt_entries(
    echo: Echo, ids: Sequence[int], entries: Sequence[TokenLogprob | None]
) -> list[TokenLogprob]:
    """A prompt's tokens ``ids`` as logprob entries; the first has no logprob (None)."""
    return [
        e if e is not None else TokenLogprob(echo.decode([t]), None, token_id=t)
        for t, e in zip(ids, entries, strict=False)
    ]
