"""Anthropic's context-management edits, applied to a conversation as Anthropic defines
them, for the targets that do not apply them themselves (the local model).

``clear_tool_uses_20250919``: once the prompt passes ``trigger`` input tokens (default
100,000), the results of all but the last ``keep`` tool uses (default 3) are replaced
by a placeholder, the tools in ``exclude_tools`` never, and with ``clear_tool_inputs``
the calls' inputs too; where ``clear_at_least`` is given and clearing would free fewer
tokens than that, nothing is cleared.  ``clear_thinking_*`` holds as a conversation
stands on the local model (no earlier thinking is shown to it).  The edited turns are
what is rendered and journaled, so the session log rebuilds the edited request.

Pure: turns and token counts in, turns out; the caller renders and counts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from manifest.canonical import canonical_json
from manifest.sessionlog import MessageEvent

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEARED_RESULT = "[This tool result was cleared to save context.]"
CLEARED_INPUT = "{}"
DEFAULT_TRIGGER = 100_000
DEFAULT_KEEP = 3


@dataclass(frozen=True)
class ClearToolUses:
    """One ``clear_tool_uses`` edit, its defaults filled in."""

    trigger: int = DEFAULT_TRIGGER
    keep: int = DEFAULT_KEEP
    clear_at_least: int = 0
    exclude: frozenset[str] = frozenset()
    clear_inputs: bool = False

    @classmethod
    def of(cls, edit: Mapping[str, Any]) -> ClearToolUses:
        def value(key: str, default: int) -> int:
            v = edit.get(key)
            return int(v.get("value", default)) if isinstance(v, Mapping) else default

        return cls(
            trigger=value("trigger", DEFAULT_TRIGGER),
            keep=value("keep", DEFAULT_KEEP),
            clear_at_least=value("clear_at_least", 0),
            exclude=frozenset(edit.get("exclude_tools") or ()),
            clear_inputs=bool(edit.get("clear_tool_inputs")),
        )

    def applies(self, prompt_tokens: int) -> bool:
        return prompt_tokens > self.trigger


def tool_use_edit(context_management: Mapping[str, Any] | None) -> ClearToolUses | None:
    """The request's ``clear_tool_uses`` edit, if it has one."""
    for edit in (context_management or {}).get("edits") or ():
        if isinstance(edit, Mapping) and edit.get("type") == CLEAR_TOOL_USES:
            return ClearToolUses.of(edit)
    return None


def _calls(turns: Sequence[MessageEvent]) -> list[tuple[str, str]]:
    """Every tool call of the conversation, in order: (call id, tool name)."""
    out: list[tuple[str, str]] = []
    for m in turns:
        if m.role == "assistant" and m.tool_calls:
            out += [(c["id"], c["function"]["name"]) for c in json.loads(m.tool_calls)]
    return out


def clear_tool_uses(
    turns: Sequence[MessageEvent], edit: ClearToolUses
) -> tuple[tuple[MessageEvent, ...], int]:
    """``turns`` with the results (and, asked, the inputs) of all but the last
    ``edit.keep`` tool uses cleared, excluded tools kept; and how many uses it cleared."""
    calls = _calls(turns)
    kept = calls[len(calls) - edit.keep :] if edit.keep > 0 else []
    cleared = {cid for cid, name in calls if (cid, name) not in kept and name not in edit.exclude}
    if not cleared:
        return tuple(turns), 0
    out: list[MessageEvent] = []
    for m in turns:
        if m.role == "tool" and m.tool_call_id in cleared and m.content != CLEARED_RESULT:
            m = replace(m, content=CLEARED_RESULT)
        elif edit.clear_inputs and m.role == "assistant" and m.tool_calls:
            calls_in = json.loads(m.tool_calls)
            for c in calls_in:
                if c["id"] in cleared:
                    c["function"]["arguments"] = CLEARED_INPUT
            m = replace(m, tool_calls=canonical_json(calls_in).decode())
        out.append(m)
    return tuple(out), len(cleared)
