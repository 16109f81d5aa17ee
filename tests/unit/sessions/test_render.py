"""The system prompt's layout (lint, stable and volatile parts), remembered per anchor."""

from __future__ import annotations

from gateway.sessions.render import SystemLayouts, layout_system

SYSTEM = "You are the support assistant.\nToday is 2026-12-01.\nAnswer briefly."


def test_the_canonical_layout_moves_flagged_lines_to_the_volatile_part() -> None:
    laid = layout_system(SYSTEM, canonical=True)
    assert laid.findings and laid.volatile is not None and "2026-12-01" in laid.volatile
    assert laid.stable is not None and "2026-12-01" not in laid.stable
    plain = layout_system(SYSTEM, canonical=False)
    assert plain.findings == laid.findings and plain.stable == SYSTEM and plain.volatile is None
    assert layout_system(None, canonical=True).stable is None


def test_layouts_are_remembered_per_anchor_and_bounded() -> None:
    layouts = SystemLayouts(size=2)
    first = layouts(SYSTEM, True)
    assert layouts(SYSTEM, True) is first  # linted once
    assert first == layout_system(SYSTEM, True)  # the same answer as uncached
    layouts("a", True)
    layouts("b", True)  # SYSTEM fell out (least recently used)
    assert layouts(SYSTEM, True) is not first
    assert layouts(SYSTEM, False) != layouts(SYSTEM, True)  # the layout is part of the key
