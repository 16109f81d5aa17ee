"""The render bench's prompts have the size asked, and its verdict reads the thread's
rows only."""

from __future__ import annotations

from pathlib import Path

from engines.tokenizer import ChatTokenizer
from loadtests.bench_render import TOOL, agent_prompt, missed, table


def test_an_agent_prompt_has_about_the_tokens_asked(demo_model: Path) -> None:
    tok = ChatTokenizer.from_pretrained(str(demo_model))
    for tokens in (2000, 6000):
        messages = agent_prompt(tok, tokens)
        n = len(tok.render_chat(messages, [TOOL]))
        assert 0.8 * tokens <= n <= 1.2 * tokens, (tokens, n)
        roles = [m["role"] for m in messages]
        assert roles[:2] == ["system", "user"] and roles.count("tool") >= tokens // 2000


def _row(tokens: int, way: str, lag_max: float) -> dict[str, object]:
    return {
        "tokens": tokens,
        "way": way,
        "renders": 10,
        "render_ms": 5.0,
        "lag_p50_ms": 1.0,
        "lag_p99_ms": 2.0,
        "lag_max_ms": lag_max,
    }


def test_the_target_is_the_loops_lateness_with_the_render_thread() -> None:
    rows = [_row(2000, "loop", 90.0), _row(2000, "thread", 3.0), _row(50000, "thread", 31.0)]
    assert missed(rows, 20.0) == [50000]  # the loop's own 90 ms is what the thread removes
    assert missed(rows, 40.0) == []
    last = table(rows).splitlines()[-1].split()
    assert last == ["50000", "thread", "10", "5.0", "1.0", "2.0", "31.0"]
