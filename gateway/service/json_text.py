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
from contextlib import aclosing

from gateway.core.shaping import Pieces


def _escape(ch: str) -> str:
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}.get(
        ch, f"\\u{ord(ch):04x}"
    )


class JsonEscaper:
    """Feed JSON text in pieces; each piece comes back with the control characters
    inside its strings escaped (the string state carries over between pieces)."""

    def __init__(self) -> None:
        self._in_string = False
        self._escaped = False  # the last character was a backslash inside a string

    def feed(self, text: str) -> str:
        if not self._in_string and '"' not in text:
            return text  # the common case outside strings: nothing to look at
        out: list[str] = []
        for ch in text:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                elif ch < " ":
                    out.append(_escape(ch))
                    continue
            elif ch == '"':
                self._in_string = True
            out.append(ch)
        return "".join(out)


async def escaped_json(pieces: Pieces) -> Pieces:
    """An answer constrained to JSON, its text escaped as :class:`JsonEscaper` does
    (one escaper per sample)."""
    escapers: dict[int, JsonEscaper] = {}
    async with aclosing(pieces):
        async for p in pieces:
            if p.text:
                text = escapers.setdefault(p.index, JsonEscaper()).feed(p.text)
                if text != p.text:
                    p = dataclasses.replace(p, text=text)
            yield p
