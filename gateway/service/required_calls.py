"""``tool_choice: "required"`` read while it is decoded.

The answer is constrained to vLLM's schema for a required call, a JSON array of
``{"name": ..., "parameters": {...}}`` (see ``tools.required_schema``).
:class:`RequiredCalls` scans it a character at a time as the pieces arrive and
turns it into tool-call deltas: a call's first delta (its id and name) as soon
as its name is complete, then its arguments (the ``parameters`` value, as the
model writes it, control characters inside strings escaped) as they come.
"""

from __future__ import annotations

import json
from typing import Literal

from engines.base import call_id
from gateway.core.pieces import ToolCallDelta
from gateway.service.json_text import JsonEscaper, JsonStrings

ITEM_DEPTH = 2  # inside [ { ... } ]: where a call's keys are


class RequiredCalls:
    def __init__(self) -> None:
        self._depth = 0
        self._strings = JsonStrings()
        self._raw: list[str] = []  # the string being read (a key or a name)
        self._reading: Literal["key", "name", "other", "args"] | None = None
        self._key: str | None = None  # the last key read in the current call
        self._value_of: str | None = None  # the key whose value comes now
        self._item = -1
        self._names: dict[int, str] = {}
        self._pending: dict[int, list[str]] = {}  # arguments read before the call's name
        self._args: list[str] = []  # arguments read in this feed
        self._args_escaper = JsonEscaper()
        self._out: list[ToolCallDelta] = []

    @property
    def calls(self) -> int:
        """Calls named so far."""
        return len(self._names)

    def feed(self, text: str) -> list[ToolCallDelta]:
        for ch in text:
            self._step(ch)
        self._flush_args()
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ scanning

    def _step(self, ch: str) -> None:
        where = self._strings.step(ch)
        if self._reading == "args":
            if where != "out" or not (self._depth == ITEM_DEPTH and ch in ",}"):
                if where == "out":
                    self._nest(ch)
                self._args.append(ch)
                return
            self._flush_args()
            self._reading = None  # and ch closes the call or separates keys
        if where == "open":
            self._raw = []
            at_item = self._depth == ITEM_DEPTH
            if at_item and self._value_of is None:
                self._reading = "key"
            elif at_item and self._value_of == "name":
                self._reading = "name"
            else:
                self._reading = "other"
        elif where == "close":
            self._end_string(json.loads('"' + "".join(self._raw) + '"', strict=False))
        elif where != "out":
            self._raw.append(ch)
        elif ch == "{" and self._depth == ITEM_DEPTH - 1:
            self._flush_args()
            self._item += 1
            self._key = self._value_of = None
            self._depth += 1
        elif ch in "[{]}":
            self._nest(ch)
        elif self._depth == ITEM_DEPTH and ch == ":":
            self._value_of = self._key
            if self._key == "parameters":
                self._reading = "args"
                self._args_escaper = JsonEscaper()
        elif self._depth == ITEM_DEPTH and ch == ",":
            self._key = self._value_of = None

    def _nest(self, ch: str) -> None:
        """Track the nesting of ``ch`` (outside strings)."""
        if ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1

    def _end_string(self, value: str) -> None:
        if self._reading == "key":
            self._key = value
        elif self._reading == "name" and self._item not in self._names:
            self._names[self._item] = value
            pending = "".join(self._pending.pop(self._item, []))
            self._out.append(ToolCallDelta(self._item, call_id(), value, pending))
        self._reading = None

    def _flush_args(self) -> None:
        if not self._args:
            return
        text = self._args_escaper.feed("".join(self._args))
        self._args = []
        if self._item in self._names:
            self._out.append(ToolCallDelta(self._item, None, None, text))
        else:
            self._pending.setdefault(self._item, []).append(text)
