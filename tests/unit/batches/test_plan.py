"""A batch's items as the prefix DAG's units: the header (model, system prompt or
instructions, tools) one segment, then each turn; what the DAG measures of them."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.batches.plan import measures, segments, units
from manifest.economics import zipf_coverage
from manifest.prefix_dag import PrefixDag


def chat(system: str, user: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def test_the_system_prompt_and_tools_are_one_header_segment_then_each_message() -> None:
    a, b = (
        segments("/v1/chat/completions", chat("S", "x")),
        segments("/v1/chat/completions", chat("S", "y")),
    )
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    other = segments("/v1/chat/completions", {**chat("S", "x"), "tools": [{"type": "function"}]})
    assert other[0] != a[0]  # tools frame the prompt
    # Anthropic's system field, the Responses API's instructions, a completion's prompt
    msg = segments(
        "/v1/messages",
        {"model": "m", "system": "S", "messages": [{"role": "user", "content": "x"}]},
    )
    assert len(msg) == 2
    resp = segments("/v1/responses", {"model": "m", "instructions": "S", "input": "x"})
    assert len(resp) == 2
    assert len(segments("/v1/completions", {"model": "m", "prompt": "x"})) == 2
    assert all(n >= 1 for _, n in a)


@pytest.mark.parametrize("big", [3, 30])
def test_measures_report_the_skew_and_the_top_7_coverage(big: int) -> None:
    # 9 instruction sets: one used by `big` items, eight by one item each
    bodies = [chat("S0", f"u{i}") for i in range(big)]
    bodies += [chat(f"S{k}", "u") for k in range(1, 9)]
    us = units("/v1/chat/completions", bodies)
    m = measures(PrefixDag(us), us)
    assert m["units"] == big + 8 and m["prefixes"] == 9
    assert m["top7_coverage"] == pytest.approx((big + 6) / (big + 8))
    assert m["anchors"] == 1  # the one shared header
    s = m["concentration"]
    assert s is not None and s > 0
    assert m["top7_coverage_zipf"] == pytest.approx(zipf_coverage(7, 9, s))
    assert m["shared_tokens"] > 0
