"""When an emulated model calls a tool, and with which arguments.

Every provider route normalizes its request to the same three facts (the
declared functions, the forced choice, whether the last turn answers a
call) and asks :func:`tool_use`.  The rule is deterministic so tests can
rely on it: ``none`` never calls; a named choice calls that function; a
required (``any``) choice calls the first; ``auto`` calls the first unless
the last turn is a tool's result (the model then answers in text).  With
``parallel`` the model calls the first two functions at once.  Arguments
fill every declared property by its JSON-schema type, with words chosen by
the request's digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common import reply_words


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolUse:
    name: str
    args: dict[str, Any]


def _value(schema: Any, word: str, i: int) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and schema.get("enum"):
        return schema["enum"][i % len(schema["enum"])]
    return {
        "integer": i + 1,
        "number": i + 0.5,
        "boolean": i % 2 == 0,
        "array": [],
        "object": {},
        "null": None,
    }.get(str(kind), word)


def arguments(fn: Function, raw: bytes) -> dict[str, Any]:
    props = fn.parameters.get("properties") or {}
    words = [w.strip() for w in reply_words(raw + fn.name.encode(), max(len(props), 1))]
    return {k: _value(s, words[i], i) for i, (k, s) in enumerate(props.items())}


def tool_use(
    functions: list[Function],
    choice: str | None,
    answered: bool,
    raw: bytes,
    parallel: bool = False,
) -> list[ToolUse]:
    """The calls the model makes (``choice``: ``auto`` | ``any`` | ``none`` | a name)."""
    if not functions or choice == "none" or (choice in (None, "auto") and answered):
        return []
    named = [f for f in functions if f.name == choice]
    chosen = named or functions[: 2 if parallel else 1]
    return [ToolUse(f.name, arguments(f, raw)) for f in chosen]
