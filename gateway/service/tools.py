"""Tool calls on the local model, with vLLM's own machinery.

The tools are rendered into the prompt by the model's chat template.  What the
model answers depends on ``tool_choice``:

- a named function: structured outputs constrain the answer to that
  function's parameters schema; the answer *is* the call's arguments, streamed
  as argument deltas;
- ``required``: structured outputs constrain it to a JSON array of
  ``{name, parameters}`` (vLLM's schema), read as it is decoded
  (``required_calls.py``): each call streams its name, then its arguments;
- ``auto``: the model writes freely and vLLM's tool-call parser for its
  template (``engine.tool_parser``, ``hermes`` by default) reads the calls out
  of the text.  Text before the parser's start marker streams as content; from
  the marker on it is held and read when the sample ends.

A sample that called tools ends with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engines.base import Structured, call_id
from engines.vllm.tool_calls import ParsedCalls
from gateway.core.pieces import Piece, ToolCallDelta
from gateway.core.schemas import ChatCompletionRequest, NamedToolChoice
from gateway.service.json_text import JsonEscaper
from gateway.service.required_calls import RequiredCalls
from manifest.canonical import canonical_json

Mode = Literal["auto", "required", "named"]
Parse = Callable[[str, list[dict[str, Any]]], ParsedCalls]


def required_schema(tools: list[dict[str, Any]], parallel: bool | None) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: required``: one or more ``{name, parameters}``."""
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


@dataclass
class _Sample:
    text: list[str] = field(default_factory=list)
    held: bool = False  # auto: the start marker was seen, the rest is a call
    sent_name: bool = False  # named: the call's first delta went out
    escaper: JsonEscaper = field(default_factory=JsonEscaper)  # named: its arguments
    required: RequiredCalls = field(default_factory=RequiredCalls)
    ids: tuple[int, ...] = ()  # output token ids read but not passed on yet


class ToolPlan:
    """How one request's tool calls are asked for and read back."""

    def __init__(self, req: ChatCompletionRequest, parse: Parse, marker: str | None) -> None:
        self.tools = req.tool_dicts()
        self._parse = parse
        self._marker = marker
        choice = req.tool_choice
        self.mode: Mode = "auto"
        self.name: str | None = None
        if isinstance(choice, NamedToolChoice):
            self.mode, self.name = "named", choice.function.name
        elif choice == "required":
            self.mode = "required"
        self._parallel = req.parallel_tool_calls

    def structured(self) -> Structured | None:
        """The constraint a forced tool choice puts on the answer (it wins over a
        ``response_format``, as in vLLM and OpenAI: the answer is a call, not text)."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.name)
            params = tool["function"].get("parameters") or {"type": "object"}
            return Structured(json_schema=canonical_json(params).decode())
        if self.mode == "required":
            schema = required_schema(self.tools, self._parallel)
            return Structured(json_schema=canonical_json(schema).decode())
        return None

    # ---------------------------------------------------------- reading

    def _calls(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments)]) of a finished sample."""
        parsed = self._parse(text, self.tools)
        return parsed.content, list(parsed.calls)

    def reader(self) -> ToolCalls:
        """A :class:`ToolCalls` step for one answer."""
        return ToolCalls(self)

    def _step(self, s: _Sample, p: Piece) -> list[Piece]:
        if self.mode == "named":
            first = not s.sent_name
            s.sent_name = True
            args = s.escaper.feed(p.text)
            delta = ToolCallDelta(
                0, call_id() if first else None, self.name if first else None, args
            )
            finish = "tool_calls" if p.finish_reason == "stop" else p.finish_reason
            return [Piece("", finish, None, p.index, p.logprobs, (delta,))]
        s.text.append(p.text)
        if self.mode == "required":
            return self._step_required(s, p)
        if p.finish_reason is None:
            if self.mode == "auto" and not s.held:
                return self._stream_content(s, p)
            return []
        return self._finish(s, p)

    def _step_required(self, s: _Sample, p: Piece) -> list[Piece]:
        """``required``: each call goes out as it is decoded (its name, then arguments)."""
        deltas = tuple(s.required.feed(p.text))
        if p.finish_reason is None:
            return [Piece("", None, None, p.index, p.logprobs, deltas)] if deltas else []
        if s.required.calls == 0:  # cut short before a call was named: the text as is
            return [Piece("".join(s.text), p.finish_reason, None, p.index, p.logprobs)]
        finish = "tool_calls" if p.finish_reason == "stop" else p.finish_reason
        return [Piece("", finish, None, p.index, p.logprobs, deltas)]

    def _stream_content(self, s: _Sample, p: Piece) -> list[Piece]:
        """``auto``: text goes out as content until the parser's start marker shows up."""
        text = "".join(s.text)
        if self._marker is None or self._marker in text:
            s.held = True  # a parser without a marker: everything is read at the end
            return []
        # keep back a tail that could be the start of the marker
        keep = next(
            (k for k in range(len(self._marker) - 1, 0, -1) if text.endswith(self._marker[:k])),
            0,
        )
        out, s.text = text[: len(text) - keep], [text[len(text) - keep :]]
        return [Piece(out, None, None, p.index, p.logprobs)] if out else []

    def _finish(self, s: _Sample, p: Piece) -> list[Piece]:
        text = "".join(s.text)
        marker = self._marker
        if self.mode == "auto" and not s.held and marker is not None and marker not in text:
            return [Piece(text, p.finish_reason, None, p.index, p.logprobs)]
        content, calls = self._calls(text)
        if not calls:
            return [Piece(text, p.finish_reason, None, p.index, p.logprobs)]
        deltas = tuple(
            ToolCallDelta(i, call_id(), name, args) for i, (name, args) in enumerate(calls)
        )
        return [Piece(content or "", "tool_calls", None, p.index, p.logprobs, deltas)]


class ToolCalls:
    """One answer's tool calls read out of its text, as its :class:`ToolPlan` says: a
    :class:`~gateway.core.pieces.Step`.  The output token ids ride on the next piece out;
    the first piece's prompt counts on the first piece out."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._samples: dict[int, _Sample] = {}
        self._head: Piece | None = None  # its prompt counts go out with the first piece out

    def step(self, p: Piece) -> Sequence[Piece]:
        head = self._head = self._head or p
        s = self._samples.get(p.index)
        if s is None:
            s = self._samples[p.index] = _Sample()
        s.ids += p.token_ids
        outs = self._plan._step(s, p)
        for i, out in enumerate(outs):
            out = dataclasses.replace(out, token_ids=s.ids)  # with the next piece out
            s.ids = ()
            if head.prompt_tokens is not None:
                out = dataclasses.replace(
                    out,
                    prompt_tokens=head.prompt_tokens,
                    cached_tokens=head.cached_tokens,
                    prompt_token_ids=head.prompt_token_ids,
                    prompt_logprobs=head.prompt_logprobs,
                )
                head = self._head = Piece()  # passed on
            outs[i] = out
        return outs

    async def end(self, last: Piece) -> Piece:
        return last
