"""Canonical prompts: byte-stable serialization, divergence, lint and layout."""

from __future__ import annotations

import json

import pytest

from manifest.canonical import (
    CanonicalPrompt,
    Divergence,
    Finding,
    Segment,
    SegmentKind,
    canonicalize,
    diverge,
    lint,
    recommend_layout,
)
from manifest.identity import (
    CANONICAL_SERIALIZER,
    ModelId,
    TokenizerId,
    VaryAxes,
    VBlockIdentity,
    content_digest,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "fetch",
            "parameters": {"properties": {"url": {"type": "string"}}, "type": "object"},
        },
    },
]
SYSTEM = "You are a careful assistant for the vcache project."


def test_reordered_keys_and_whitespace_give_identical_bytes() -> None:
    shuffled = json.loads(json.dumps(TOOLS))
    shuffled[0]["function"] = {
        "parameters": shuffled[0]["function"]["parameters"],
        "name": "search",
    }
    call_a = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "search", "arguments": '{"q": "kv", "top_k": 3}'},
            }
        ],
    }
    call_b = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "id": "c1",
                "function": {"arguments": '{\n  "top_k":3,"q":"kv"}', "name": "search"},
            }
        ],
    }
    a = canonicalize([{"role": "user", "content": "hi"}, call_a], tools=TOOLS, system=SYSTEM)
    b = canonicalize([{"content": "hi", "role": "user"}, call_b], tools=shuffled, system=SYSTEM)
    assert a.render() == b.render()
    assert diverge(a, b) is None
    assert b'"arguments":"{\\"q\\":\\"kv\\",\\"top_k\\":3}"' in a.render()


def test_non_json_arguments_are_sent_as_given() -> None:
    call = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}],
    }
    assert b'"arguments":"not json"' in canonicalize([call]).render()
    call2 = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "f", "arguments": {"b": 1, "a": 2}}}],
    }
    assert b'"arguments":"{\\"a\\":2,\\"b\\":1}"' in canonicalize([call2]).render()


def test_segments_in_prefix_order_with_kinds() -> None:
    p = canonicalize(
        [{"role": "user", "content": "q"}, {"role": "tool", "content": "r", "tool_call_id": "c1"}],
        tools=TOOLS,
        system=SYSTEM,
        volatile_system="today is 2026-11-29",
    )
    assert p.keys() == ["tools", "system", "system:volatile", "message:0", "message:1"]
    assert [s.kind for s in p.segments] == [
        SegmentKind.TOOL_SCHEMA,
        SegmentKind.STABLE,
        SegmentKind.VOLATILE,
        SegmentKind.MESSAGE,
        SegmentKind.TOOL_RESULT,
    ]
    assert p.offsets()[1] == len(p.segments[0].data)
    assert "careful" not in repr(p.segments[1])  # prompts never reach logs
    assert f"{len(p.segments[1].data)} bytes" in repr(p.segments[1])


def test_diverge_finds_a_timestamp_inserted_in_the_system_prompt() -> None:
    before = canonicalize([{"role": "user", "content": "hi"}], tools=TOOLS, system=SYSTEM)
    stamped = SYSTEM.replace("assistant", "assistant (2026-11-29T12:00:00Z)")
    after = canonicalize([{"role": "user", "content": "hi"}], tools=TOOLS, system=stamped)
    d = diverge(before, after)
    tools_len = len(before.segments[0].data)
    # the segment opens with a JSON quote; the bytes part at "(" versus "for"
    in_segment = 1 + len("You are a careful assistant ")
    assert d == Divergence(1, "system", tools_len + in_segment, in_segment)
    assert before.render()[: d.byte_offset] == after.render()[: d.byte_offset]
    assert before.render()[d.byte_offset] != after.render()[d.byte_offset]


def test_diverge_on_extension_and_truncation() -> None:
    one = canonicalize([{"role": "user", "content": "a"}])
    two = canonicalize([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert diverge(one, two) is None  # appending keeps the prefix
    d = diverge(two, one)
    assert d == Divergence(1, "message:1", len(one.render()), 0)
    short = CanonicalPrompt((Segment("x", SegmentKind.MESSAGE, b"abc"),))
    longer = CanonicalPrompt((Segment("x", SegmentKind.MESSAGE, b"abcd"),))
    assert diverge(short, longer) == Divergence(0, "x", 3, 3)


def test_lint_names_unstable_content_without_quoting_it() -> None:
    system = (
        "Now: 2026-11-29T12:00:00Z. Request 123e4567-e89b-12d3-a456-426614174000 "
        "at 12:30:01, epoch 1795954451."
    )
    p = canonicalize([{"role": "user", "content": "hi"}], system=system)
    findings = lint(p)
    assert [f.rule for f in findings] == ["timestamp", "uuid", "clock", "epoch"]
    assert all(f.segment_key == "system" for f in findings)
    rendered = p.render()
    first = findings[0]
    assert rendered[first.byte_offset : first.byte_offset + first.length] == b"2026-11-29T12:00:00Z"


def test_lint_skips_volatile_and_tool_results_and_flags_reordered_tools() -> None:
    p = canonicalize(
        [{"role": "tool", "content": "at 2026-01-01", "tool_call_id": "x"}],
        volatile_system="today is 2026-11-29",
    )
    assert lint(p) == []
    before = canonicalize([], tools=TOOLS)
    after = canonicalize([], tools=list(reversed(TOOLS)))
    assert lint(after, previous=before) == [
        Finding("reordered_tools", "tools", 0, len(after.segments[0].data))
    ]
    assert lint(after, previous=after) == []


def test_recommend_layout_moves_volatile_after_stable() -> None:
    p = canonicalize(
        [{"role": "user", "content": "q"}],
        tools=TOOLS,
        system="Today is 2026-11-29. Be brief.",
        volatile_system="request id 42",
    )
    out = recommend_layout(p, lint(p))
    assert out.keys() == ["tools", "message:0", "system", "system:volatile"]
    assert {s.kind for s in out.segments[2:]} == {SegmentKind.VOLATILE}
    assert recommend_layout(
        canonicalize([{"role": "user", "content": "q"}], system=SYSTEM)
    ).keys() == ["system", "message:0"]


def test_vblock_identity_keys_every_axis() -> None:
    base = VBlockIdentity(content_digest(b"anchor"), ModelId("m"), TokenizerId("t"))
    assert base.serializer == CANONICAL_SERIALIZER
    variants = [
        VBlockIdentity(content_digest(b"anchor"), ModelId("m2"), TokenizerId("t")),
        VBlockIdentity(content_digest(b"anchor"), ModelId("m"), TokenizerId("t2")),
        VBlockIdentity(
            content_digest(b"anchor"),
            ModelId("m"),
            TokenizerId("t"),
            vary=VaryAxes(reasoning_mode="high"),
        ),
        VBlockIdentity(
            content_digest(b"anchor"),
            ModelId("m"),
            TokenizerId("t"),
            vary=VaryAxes(cache_salt="tenant:b"),
        ),
        VBlockIdentity(content_digest(b"other"), ModelId("m"), TokenizerId("t")),
    ]
    assert len({base.id, *(v.id for v in variants)}) == 6
    child = base.child(content_digest(b"unit-1"))
    assert child.parent == base.id and child.model == base.model
    assert child.id != base.child(content_digest(b"unit-2")).id
    assert hash(base) == hash(
        VBlockIdentity(content_digest(b"anchor"), ModelId("m"), TokenizerId("t"))
    )
    with pytest.raises(ValueError, match="sha256"):
        VBlockIdentity("abc", ModelId("m"), TokenizerId("t"))  # type: ignore[arg-type]


def test_split_volatile_keeps_order_and_moves_flagged_lines() -> None:
    from manifest.canonical import split_volatile

    text = "You are helpful.\nNow: 2026-11-29T10:00:00Z\nBe brief.\nRequest 1764410000\n"
    stable, volatile = split_volatile(text)
    assert stable == "You are helpful.\nBe brief.\n"
    assert volatile == "Now: 2026-11-29T10:00:00Z\nRequest 1764410000\n"
    assert split_volatile("plain\n") == ("plain\n", "")
