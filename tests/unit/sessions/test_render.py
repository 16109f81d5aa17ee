"""The system prompt's layout (lint, stable and volatile parts), remembered per anchor;
the vLLM payload's bytes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.lora import LoraRef
from gateway.sessions.render import (
    SystemLayouts,
    canonical_object,
    layout_system,
    token_ids_json,
    vllm_payload,
)
from manifest.canonical import canonical_json

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


def _payload_as_it_was(
    ids: list[int],
    salt: str | None,
    sampling: Any,
    images: list[str],
    lora: LoraRef | None,
    uuids: list[str | None],
) -> bytes:
    """The payload as one canonical_json of the whole object (what logs hold digests of)."""
    out: dict[str, Any] = {"prompt_token_ids": ids, "cache_salt": salt, "sampling": sampling}
    if images:
        out["images"] = images
    if any(u is not None for u in uuids):
        out["image_uuids"] = uuids
    if lora is not None:
        adapter = {"name": lora.name, "path": lora.path}
        out["adapter"] = adapter | ({} if lora.sha256 is None else {"sha256": lora.sha256})
    return canonical_json(out)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=64),
    salt=st.none() | st.text(),
    sampling=st.dictionaries(st.text(), _JSON, max_size=6),
    images=st.lists(st.text(alphabet="0123456789abcdef", min_size=64, max_size=64), max_size=3),
    lora=st.none()
    | st.builds(LoraRef, st.text(min_size=1), st.text(min_size=1), st.none() | st.text()),
    uuids=st.lists(st.none() | st.text(), max_size=3),
)
def test_the_vllm_payload_is_the_canonical_json_it_always_was(
    ids: list[int],
    salt: str | None,
    sampling: dict[str, Any],
    images: list[str],
    lora: LoraRef | None,
    uuids: list[str | None],
) -> None:
    """The ids are written apart (msgspec, not json's encoder) and spliced in: the bytes
    are those the logs' digests were taken of, byte for byte."""
    got = vllm_payload(ids, salt, sampling, images, lora, uuids)
    assert got == _payload_as_it_was(ids, salt, sampling, images, lora, uuids)
    assert vllm_payload(tuple(ids), salt, sampling, images, lora, uuids) == got


def test_token_ids_are_written_as_json_writes_them() -> None:
    for ids in ([], [0], [True, False, 3], [2**64 + 1, -(2**70)], range(5)):
        assert token_ids_json(ids) == canonical_json(list(ids))
    with pytest.raises(TypeError):
        token_ids_json([object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="a member twice"):
        canonical_object({"a": 1}, {"a": b"2"})
