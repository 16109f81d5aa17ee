"""An answer accumulated from its pieces: each sample's text, logprobs, tool calls and
thinking blocks as they arrive (:class:`Sample`), and a whole answer read to its end
(:func:`collect`)."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from engines.base import TokenLogprob
from gateway.core.outputs import FunctionCallOut, ToolCallOut, Usage
from gateway.core.pieces import Piece, Pieces


@dataclass
class _Call:
    """One tool call as its deltas arrive."""

    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class _Thought:
    text: list[str] = field(default_factory=list)
    signature: list[str] = field(default_factory=list)
    redacted: str | None = None

    def block(self) -> dict[str, Any]:
        if self.redacted is not None:
            return {"type": "redacted_thinking", "data": self.redacted}
        return {
            "type": "thinking",
            "thinking": "".join(self.text),
            "signature": "".join(self.signature),
        }


@dataclass
class Sample:
    """One sample of an answer, as its pieces arrive."""

    text: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    thoughts: dict[int, _Thought] = field(default_factory=dict)
    stop_sequence: str | None = None
    token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def add(self, p: Piece) -> None:
        self.stop_sequence = p.stop_sequence or self.stop_sequence
        self.text.append(p.text)
        self.token_ids += p.token_ids
        if p.prompt_token_ids is not None:
            self.prompt_token_ids = p.prompt_token_ids
        if p.prompt_logprobs is not None:
            self.prompt_logprobs = p.prompt_logprobs
        self.logprobs += p.logprobs
        self.finish_reason = p.finish_reason or self.finish_reason
        for t in p.thinking:
            thought = self.thoughts.setdefault(t.index, _Thought())
            thought.text.append(t.text)
            thought.signature.append(t.signature)
            thought.redacted = t.redacted if t.redacted is not None else thought.redacted
        for d in p.tool_calls:
            call = self.calls.setdefault(d.index, _Call())
            call.id = d.id or call.id
            call.name = d.name or call.name
            call.arguments.append(d.arguments)

    def thinking_blocks(self) -> list[dict[str, Any]]:
        """The thinking blocks, whole, in order (Anthropic's shape)."""
        return [t.block() for _, t in sorted(self.thoughts.items())]

    def tool_calls(self) -> list[ToolCallOut] | None:
        if not self.calls:
            return None
        return [
            ToolCallOut(
                id=c.id, function=FunctionCallOut(name=c.name, arguments="".join(c.arguments))
            )
            for _, c in sorted(self.calls.items())
        ]


async def collect(pieces: Pieces, n: int = 1) -> tuple[list[Sample], Usage]:
    """The whole answer: each sample's text, finish reason and logprobs, and the usage."""
    samples = [Sample() for _ in range(n)]
    usage = Usage.of(0, 0, 0)
    async with aclosing(pieces):
        async for p in pieces:
            samples[p.index].add(p)
            usage = p.usage or usage
    return samples, usage
