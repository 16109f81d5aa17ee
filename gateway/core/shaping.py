"""OpenAI's shapes of an answer: its pieces (:mod:`gateway.core.pieces`) turned into a
chat completion (whole or as chunks) and a text completion (whole or as chunks), with
what the client asked them to carry (:class:`Shape`).  The gRPC edge, the Responses and
the Messages APIs shape the same pieces in their own modules.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from gateway.core.logprob_shapes import chat_logprobs, completion_logprobs, prompt_logprobs
from gateway.core.outputs import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    FunctionDeltaOut,
    ToolCallDeltaOut,
    Usage,
)
from gateway.core.pieces import Piece, Pieces, ToolCallDelta
from gateway.core.samples import Sample, collect


@dataclass(frozen=True)
class Shape:
    """What the client asked the answer to carry."""

    n: int = 1
    logprobs: bool = False
    include_usage: bool = False
    token_ids: bool = False  # vLLM's return_token_ids
    prompt_logprobs: bool = False  # vLLM's
    as_token_ids: bool = False  # vLLM's return_tokens_as_token_ids
    # vLLM's stream_options.continuous_usage_stats (only ever with include_usage)
    continuous_usage: bool = False
    echo: str = ""  # vLLM's chat echo: each choice's content starts with this


class _Running:
    """Each choice's usage so far, for a stream's every chunk (vLLM's continuous usage
    stats): its prompt (known at its first piece) and the tokens generated."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._prompt: dict[int, tuple[int, int]] = {}
        self._out: dict[int, int] = {}

    def start(self, p: Piece) -> None:
        """``p``'s prompt counts, where it carries them (a choice's first piece)."""
        if self.on and p.prompt_tokens is not None:
            self._prompt[p.index] = (p.prompt_tokens, p.cached_tokens or 0)

    def see(self, p: Piece) -> None:
        if self.on:
            self.start(p)
            self._out[p.index] = self._out.get(p.index, 0) + len(p.token_ids)

    def now(self, index: int) -> Usage | None:
        if not self.on:
            return None
        prompt, cached = self._prompt.get(index, (0, 0))
        return Usage.of(prompt, self._out.get(index, 0), cached)


def _prompt_extras(shape: Shape, s: Sample | Piece) -> dict[str, Any]:
    """vLLM's prompt fields of an answer (chat) or a choice (text), where asked."""
    out: dict[str, Any] = {}
    if shape.token_ids and s.prompt_token_ids is not None:
        out["prompt_token_ids"] = list(s.prompt_token_ids)
    if shape.prompt_logprobs and s.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs(s.prompt_logprobs)
    return out


def _content(shape: Shape, s: Sample) -> str | None:
    """A whole choice's content: what it echoes, then its text (None: only tool calls)."""
    text = shape.echo + "".join(s.text)
    return (text or None) if s.calls else text


async def chat_completion(rid: str, model: str, pieces: Pieces, shape: Shape) -> ChatCompletion:
    samples, usage = await collect(pieces, shape.n)
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(
                content=_content(shape, s),
                tool_calls=s.tool_calls(),
            ),
            finish_reason=s.finish_reason,
            logprobs=chat_logprobs(s.logprobs, shape.as_token_ids) if shape.logprobs else None,
            **({"token_ids": list(s.token_ids)} if shape.token_ids else {}),
        )
        for i, s in enumerate(samples)
    ]
    extras = _prompt_extras(shape, samples[0]) if samples else {}
    return ChatCompletion(id=rid, model=model, choices=choices, usage=usage, **extras)


async def chat_chunks(
    rid: str, model: str, pieces: Pieces, shape: Shape
) -> AsyncGenerator[list[ChatCompletionChunk], None]:
    """OpenAI's chat stream: each choice's role, the text as it comes, the finish reasons
    in last empty deltas, then (``include_usage``) a chunk with only the usage.  Yields
    the chunks of one piece together (the roles with the first piece's): they are made
    at once, and go out in one write."""
    created = int(time.time())

    running = _Running(shape.continuous_usage)

    def chunk(
        index: int,
        delta: ChunkDelta,
        finish: str | None = None,
        lps: Any = None,
        ids: tuple[int, ...] | None = None,
        **extras: Any,
    ) -> ChatCompletionChunk:
        more = {"token_ids": list(ids)} if ids is not None and shape.token_ids else {}
        choice = ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lps, **more)
        return ChatCompletionChunk(
            id=rid,
            created=created,
            model=model,
            choices=[choice],
            usage=running.now(index),
            **extras,
        )

    finish: dict[int, str] = {}
    async with aclosing(pieces):  # closing the chunks closes the answer (and its request)
        first = await anext(pieces, None)  # primed: what the engine knew at the start
        head: dict[str, Any] = {}
        if first is not None:
            running.start(first)
            head = _prompt_extras(shape, first)
        roles = [
            chunk(i, ChunkDelta(role="assistant", content=shape.echo), **(head if i == 0 else {}))
            for i in range(shape.n)
        ]
        ended: set[int] = set()  # samples whose finish reason went out with their last text

        def step(p: Piece) -> list[ChatCompletionChunk]:
            """The chunks of one piece (a plain step: no generator per piece)."""
            out: list[ChatCompletionChunk] = []
            running.see(p)
            if p.finish_reason:
                finish[p.index] = p.finish_reason
            if p.text or (shape.token_ids and p.token_ids) or (shape.logprobs and p.logprobs):
                lps = chat_logprobs(p.logprobs, shape.as_token_ids) if shape.logprobs else None
                last = p.finish_reason if not p.tool_calls else None  # vLLM's: with the text
                if last:
                    ended.add(p.index)
                delta = ChunkDelta(content=p.text)
                out.append(chunk(p.index, delta, last, lps=lps, ids=p.token_ids))
            if p.tool_calls:
                calls = [_call_delta(d) for d in p.tool_calls]
                out.append(chunk(p.index, ChunkDelta(tool_calls=calls)))
            if p.usage is not None:
                for i in range(shape.n):
                    if i not in ended:
                        out.append(chunk(i, ChunkDelta(), finish.get(i, "stop")))
                if shape.include_usage:
                    out.append(
                        ChatCompletionChunk(
                            id=rid, created=created, model=model, choices=[], usage=p.usage
                        )
                    )
            return out

        yield roles + (step(first) if first is not None else [])
        async for p in pieces:
            if out := step(p):
                yield out


def _call_delta(d: ToolCallDelta) -> ToolCallDeltaOut:
    first = d.id is not None
    return ToolCallDeltaOut(
        index=d.index,
        id=d.id,
        type="function" if first else None,
        function=FunctionDeltaOut(name=d.name, arguments=d.arguments),
    )


def _ids(shape: Shape, s: Sample | Piece) -> dict[str, Any]:
    """vLLM's fields of a completion choice, where asked: ``return_token_ids``' prompt and
    output ids, the prompt's logprobs."""
    extras = _prompt_extras(shape, s)
    if shape.token_ids:
        extras["token_ids"] = list(s.token_ids)
    return extras


async def completion(rid: str, model: str, pieces: Pieces, shape: Shape) -> Completion:
    samples, usage = await collect(pieces, shape.n)
    choices = [
        CompletionChoice(
            index=i,
            text="".join(s.text),
            finish_reason=s.finish_reason,
            logprobs=(
                completion_logprobs(s.logprobs, 0, shape.as_token_ids) if shape.logprobs else None
            ),
            **_ids(shape, s),
        )
        for i, s in enumerate(samples)
    ]
    return Completion(id=rid, model=model, choices=choices, usage=usage)


async def completion_chunks(
    rid: str, model: str, pieces: Pieces, shape: Shape
) -> AsyncGenerator[list[Completion], None]:
    """OpenAI's text-completion stream: one chunk per piece of text (a sample's last with
    its finish reason), then (``include_usage``) a chunk with only the usage; each piece's
    as one write, as every stream yields them."""
    offsets = [0] * shape.n
    running = _Running(shape.continuous_usage)
    async with aclosing(pieces):
        async for p in pieces:
            if p.usage is None:
                running.see(p)
                lps = None
                if shape.logprobs:
                    lps = completion_logprobs(p.logprobs, offsets[p.index], shape.as_token_ids)
                offsets[p.index] += len(p.text)
                choice = CompletionChoice(
                    index=p.index,
                    text=p.text,
                    finish_reason=p.finish_reason,
                    logprobs=lps,
                    **_ids(shape, p),
                )
                yield [
                    Completion(id=rid, model=model, choices=[choice], usage=running.now(p.index))
                ]
            elif shape.include_usage:
                yield [Completion(id=rid, model=model, choices=[], usage=p.usage)]
