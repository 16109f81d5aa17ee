"""The planner in each regime, narrated with exact numbers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manifest.canonical import SegmentKind
from manifest.planner import (
    Boundary,
    CapabilityProfile,
    Plan,
    PromptLayout,
    Regime,
    TargetState,
    WarmPrimitive,
    anthropic_profile,
    client_breakpoints,
    deepseek_profile,
    local_vllm_profile,
    openai_profile,
    plan,
)

S, T, M, V = SegmentKind.STABLE, SegmentKind.TOOL_SCHEMA, SegmentKind.MESSAGE, SegmentKind.VOLATILE


def layout(*parts: tuple[str, SegmentKind, int]) -> PromptLayout:
    total, out = 0, []
    for key, kind, n in parts:
        total += n
        out.append(Boundary(key, kind, total))
    return PromptLayout(tuple(out))


AGENT = layout(
    ("tools", T, 900),
    ("system", S, 700),  # stable region ends at 1600 tokens
    ("message:0", M, 300),
    ("message:1", M, 500),
    ("message:2", M, 400),
    ("message:3", M, 200),  # 3000 tokens in all
)


def test_local_exact_predicts_whole_resident_blocks() -> None:
    prof = local_vllm_profile("replica-0", block_size=128)
    p = plan(AGENT, prof, TargetState(resident_tokens=1664))
    # 2999 tokens can be cached (never the last one): 23 full blocks, 13 of them resident
    assert (p.predicted_cached_tokens, p.predicted_written_tokens) == (1664, 2944 - 1664)
    assert p.breakpoints == ()
    assert p.cost == 3000 - 1664  # reads are free on the local engine
    # never the last token: a fully resident prompt still recomputes its tail block
    full = plan(layout(("m", M, 256)), prof, TargetState(resident_tokens=256))
    assert full.predicted_cached_tokens == 128


def test_anthropic_breakpoints_stable_region_then_tip_at_most_four() -> None:
    prof = anthropic_profile("claude-sonnet-4-6")
    assert prof.min_prefix_tokens == 1024
    cold = plan(AGENT, prof, TargetState())
    assert cold.anchors == (1, 2, 3, 4, 5)  # "tools" (900) is below the minimum
    assert len(cold.breakpoints) <= 4
    assert cold.breakpoints == (1, 2, 4, 5)  # stable end, tip, then spread
    assert all(AGENT.boundaries[i].tokens >= 1024 for i in cold.breakpoints)
    assert cold.predicted_cached_tokens == 0
    assert cold.predicted_written_tokens == 3000
    assert cold.cost == pytest.approx(3000 + 3000 * 0.25)

    warm = plan(AGENT, prof, TargetState(believed_warm_tokens=2400, warm_probability=0.9))
    assert warm.breakpoints == (1, 3, 4, 5)  # the warm boundary (message:1) is marked to be read
    assert warm.predicted_cached_tokens == 2400
    assert warm.predicted_written_tokens == 600
    assert warm.cost == pytest.approx(2400 * 0.1 + 600 * 0.25 + 600)

    doubt = plan(AGENT, prof, TargetState(believed_warm_tokens=2400, warm_probability=0.3))
    assert doubt.predicted_cached_tokens == 0  # a belief under 0.5 is not counted


def test_haiku_minimum_and_short_prompts_place_no_breakpoint() -> None:
    prof = anthropic_profile("claude-haiku-4-5-20251001", ttl_s=3600)
    assert (prof.min_prefix_tokens, prof.write_mult) == (4096, 2.0)
    p = plan(AGENT, prof, TargetState())
    assert p.breakpoints == () and p.anchors == ()


def test_volatile_segments_are_never_anchors() -> None:
    lay = layout(("system", S, 1200), ("clock", V, 10), ("message:0", M, 100))
    p = plan(lay, anthropic_profile("claude-sonnet-4-5"), TargetState())
    assert p.anchors == (0, 2)


def test_implicit_providers_round_down_to_granularity_past_the_minimum() -> None:
    p = plan(
        AGENT, openai_profile("gpt-5"), TargetState(believed_warm_tokens=2000, warm_probability=1)
    )
    assert p.predicted_cached_tokens == 1920  # 15 blocks of 128
    assert p.predicted_written_tokens == 0
    assert p.cost == pytest.approx(1920 * 0.5 + (3000 - 1920))
    small = plan(
        AGENT, openai_profile("gpt-5"), TargetState(believed_warm_tokens=1000, warm_probability=1)
    )
    assert small.predicted_cached_tokens == 0  # below 1024: nothing is cached
    ds = plan(
        AGENT,
        deepseek_profile("deepseek-chat"),
        TargetState(believed_warm_tokens=100, warm_probability=1),
    )
    assert ds.predicted_cached_tokens == 64


def test_profile_and_layout_validation() -> None:
    with pytest.raises(ValueError):
        CapabilityProfile("x", Regime.IMPLICIT, 0, 128, 2, (), WarmPrimitive.NONE)
    with pytest.raises(ValueError):
        CapabilityProfile("x", Regime.IMPLICIT, 0, 0, 0, (), WarmPrimitive.NONE)
    with pytest.raises(ValueError):
        PromptLayout((Boundary("a", M, 10), Boundary("b", M, 5)))
    with pytest.raises(ValueError):
        Plan("x", Regime.EXPLICIT, (), (2, 1), 0, 0, 0.0)
    assert PromptLayout(()).total_tokens == 0


sizes = st.lists(
    st.tuples(st.sampled_from([S, T, M, V]), st.integers(0, 3000)), min_size=1, max_size=30
)


@settings(max_examples=300, deadline=None)
@given(parts=sizes, warm=st.integers(0, 60000), minimum=st.sampled_from([1024, 2048, 4096]))
def test_breakpoint_invariants(
    parts: list[tuple[SegmentKind, int]], warm: int, minimum: int
) -> None:
    lay = layout(*[(f"s{i}", k, n) for i, (k, n) in enumerate(parts)])
    prof = CapabilityProfile(
        "a", Regime.EXPLICIT, minimum, 1, 4, (300,), WarmPrimitive.MAX_TOKENS_0, 0.1, 1.25
    )
    p = plan(lay, prof, TargetState(believed_warm_tokens=warm, warm_probability=1))
    assert len(p.breakpoints) <= 4
    assert all(lay.boundaries[i].tokens >= minimum for i in p.breakpoints)
    assert set(p.breakpoints) <= set(p.anchors)
    assert 0 <= p.predicted_cached_tokens <= min(warm, lay.total_tokens)
    assert p.predicted_cached_tokens + p.predicted_written_tokens <= lay.total_tokens


def test_gemini_profile_is_implicit_with_a_cached_content_warm() -> None:
    from manifest.planner import Regime, WarmPrimitive, gemini_profile

    flash, pro = gemini_profile("gemini-2.5-flash"), gemini_profile("gemini-2.5-pro")
    assert (flash.min_prefix_tokens, pro.min_prefix_tokens) == (2048, 4096)
    assert flash.regime is Regime.IMPLICIT and flash.warm is WarmPrimitive.CACHED_CONTENT


def test_client_breakpoints_taken_as_sent_only_when_valid() -> None:
    """A client's own marks: valid on Anthropic (sorted, deduplicated), refused when one
    names no boundary, falls below the minimum prefix, or there are more than four; an
    implicit provider never takes them."""
    a = anthropic_profile("claude-sonnet-4-5")
    four = layout(*[(f"message:{i}", M, 1100) for i in range(5)])
    assert client_breakpoints(AGENT, a, ["message:1", "system", "system"]) == (1, 3)
    assert client_breakpoints(AGENT, a, ["tools"]) is None  # 900 tokens < 1024
    assert client_breakpoints(AGENT, a, ["message:9"]) is None
    assert client_breakpoints(AGENT, a, []) is None
    assert client_breakpoints(four, a, [f"message:{i}" for i in range(4)]) == (0, 1, 2, 3)
    assert client_breakpoints(four, a, [f"message:{i}" for i in range(5)]) is None
    assert client_breakpoints(AGENT, openai_profile("gpt-5"), ["system"]) is None
