"""Anthropic's ``clear_tool_uses`` edit, applied as Anthropic defines it: past the
trigger, all but the last ``keep`` tool results become a placeholder, excluded tools
never, inputs too when asked; below the trigger nothing changes."""

from __future__ import annotations

import json

from gateway.service.context_edits import (
    CLEARED_INPUT,
    CLEARED_RESULT,
    ClearToolUses,
    clear_tool_uses,
    tool_use_edit,
)
from manifest.canonical import canonical_json
from manifest.sessionlog import MessageEvent


def _turns(names: list[str]) -> list[MessageEvent]:
    """A user turn, then one call and its result per name."""
    out = [MessageEvent("user", "fix the bug")]
    for i, name in enumerate(names):
        call = [
            {
                "id": f"c{i}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps({"n": i})},
            }
        ]
        out.append(MessageEvent("assistant", "", tool_calls=canonical_json(call).decode()))
        out.append(MessageEvent("tool", f"result {i}", tool_call_id=f"c{i}"))
    return out


def test_the_edit_is_read_with_anthropics_defaults() -> None:
    cm = {"edits": [{"type": "clear_thinking_20251015"}, {"type": "clear_tool_uses_20250919"}]}
    edit = tool_use_edit(cm)
    assert edit == ClearToolUses(trigger=100_000, keep=3)
    assert not edit.applies(100_000) and edit.applies(100_001)
    given = tool_use_edit(
        {
            "edits": [
                {
                    "type": "clear_tool_uses_20250919",
                    "trigger": {"type": "input_tokens", "value": 500},
                    "keep": {"type": "tool_uses", "value": 1},
                    "exclude_tools": ["Read"],
                    "clear_at_least": {"type": "input_tokens", "value": 20},
                    "clear_tool_inputs": True,
                }
            ]
        }
    )
    assert given == ClearToolUses(500, 1, 20, frozenset({"Read"}), True)
    assert tool_use_edit({"edits": [{"type": "clear_thinking_20251015"}]}) is None
    assert tool_use_edit(None) is None


def test_all_but_the_last_keep_results_are_cleared_excluded_tools_never() -> None:
    turns = _turns(["Bash", "Read", "Bash", "Edit", "Bash"])
    out, n = clear_tool_uses(turns, ClearToolUses(keep=2, exclude=frozenset({"Read"})))
    results = [m.content for m in out if m.role == "tool"]
    # c0 (Bash) and c2 (Bash) cleared; c1 is Read (excluded); c3, c4 the last two kept
    assert results == [CLEARED_RESULT, "result 1", CLEARED_RESULT, "result 3", "result 4"]
    assert n == 2
    assert [m.tool_calls for m in out] == [m.tool_calls for m in turns]  # inputs kept
    again, m = clear_tool_uses(out, ClearToolUses(keep=2, exclude=frozenset({"Read"})))
    assert again == out and m == 2  # idempotent: the same turns, the same prompt


def test_inputs_are_cleared_when_asked() -> None:
    out, _ = clear_tool_uses(_turns(["Bash", "Bash"]), ClearToolUses(keep=1, clear_inputs=True))
    first = json.loads(out[1].tool_calls or "[]")[0]["function"]["arguments"]
    last = json.loads(out[3].tool_calls or "[]")[0]["function"]["arguments"]
    assert first == CLEARED_INPUT and json.loads(last) == {"n": 1}


def test_nothing_to_clear_leaves_the_turns() -> None:
    turns = _turns(["Bash"])
    assert clear_tool_uses(turns, ClearToolUses()) == (tuple(turns), 0)
