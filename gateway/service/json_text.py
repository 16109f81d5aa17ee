"""JSON text as strict parsers take it, from what a constrained model writes.

vLLM's JSON grammar lets a string hold raw control characters (U+0000 to U+001F),
which JSON forbids inside strings: ``json.loads`` refuses them, and so do the
clients that parse tool arguments.  :class:`JsonEscaper` rewrites each such
character inside a string as its ``\\u00XX`` escape, chunk by chunk, keeping
every other byte as the model wrote it (outside strings a control character is
whitespace or an error either way, and is left alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from engines.base import GenerateRequest
from gateway.core.pieces import Piece


def _escape(ch: str) -> str:
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}.get(
        ch, f"\\u{ord(ch):04x}"
    )


Where = Literal["out", "open", "text", "escape", "close"]


class JsonStrings:
    """Where each character of a JSON text falls, fed one at a time: outside strings,
    a string's opening quote, its text, a backslash escape (the backslash and the
    character it escapes), or its closing quote."""

    def __init__(self) -> None:
        self.in_string = False
        self._escaped = False  # the last character was a backslash inside a string

    def step(self, ch: str) -> Where:
        if not self.in_string:
            if ch == '"':
                self.in_string = True
                return "open"
            return "out"
        if self._escaped:
            self._escaped = False
            return "escape"
        if ch == "\\":
            self._escaped = True
            return "escape"
        if ch == '"':
            self.in_string = False
            return "close"
        return "text"


class JsonEscaper:
    """Feed JSON text in pieces; each piece comes back with the control characters
    inside its strings escaped (the string state carries over between pieces)."""

    def __init__(self) -> None:
        self._strings = JsonStrings()

    def feed(self, text: str) -> str:
        if not self._strings.in_string and '"' not in text:
            return text  # the common case outside strings: nothing to look at
        out: list[str] = []
        for ch in text:
            where = self._strings.step(ch)
            out.append(_escape(ch) if where == "text" and ch < " " else ch)
        return "".join(out)


class JsonText:
    """An answer constrained to JSON, its text escaped as :class:`JsonEscaper` does (one
    escaper per sample): a :class:`~gateway.core.pieces.Step`."""

    def __init__(self) -> None:
        self._escapers: dict[int, JsonEscaper] = {}

    def step(self, p: Piece) -> Sequence[Piece]:
        if p.text:
            text = self._escapers.setdefault(p.index, JsonEscaper()).feed(p.text)
            if text != p.text:
                p = dataclasses.replace(p, text=text)
        return (p,)

    async def end(self, last: Piece) -> Piece:
        return last


def json_answer(greq: GenerateRequest) -> bool:
    """Whether the answer is constrained to JSON (its strings are escaped for strict
    parsers)."""
    st = greq.sampling.structured
    return st is not None and (st.json_schema is not None or st.json_object)
