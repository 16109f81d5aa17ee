"""``vcache plan --batch-file``: a batch planned before it is sent, with no gateway, from
an OpenAI input file or an Anthropic Message Batches body; a file the API would
refuse is refused the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from tests.unit.batches.test_message_batches import params
from tests.unit.batches.test_openai_batches import ARRIVAL, chat_body, jsonl, line


def test_an_openai_file_is_planned_in_dag_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "in.jsonl"
    f.write_bytes(jsonl([line(tag, chat_body(s, tag)) for s, tag in ARRIVAL]))
    assert main(["plan", "--batch-file", str(f)]) == 0
    out = capsys.readouterr().out
    assert "batch plan for /v1/chat/completions" in out
    assert "items             6" in out and "top-7 coverage    100%" in out
    rows = [r for r in (ln.split() for ln in out.splitlines()) if len(r) == 4 and r[0].isdigit()]
    assert [(r[1], r[2]) for r in rows] == [
        ("a1", "-"),
        ("a2", "a1"),
        ("a3", "a1"),
        ("b1", "-"),
        ("b2", "b1"),
        ("b3", "b1"),
    ]
    assert "billed vs" in out and "in arrival order" in out


def test_an_anthropic_body_is_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "batch.json"
    reqs = [{"custom_id": t, "params": params(s, t)} for s, t in ARRIVAL]
    f.write_text(json.dumps({"requests": reqs}))
    assert main(["plan", "--batch-file", str(f)]) == 0
    assert "batch plan for /v1/messages" in capsys.readouterr().out


def test_a_file_the_api_refuses_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "bad.jsonl"
    good = line("a", chat_body("A", "x"))
    f.write_bytes(jsonl([good]) + b"{not json\n")
    assert main(["plan", "--batch-file", str(f)]) == 1
    assert "line 2" in capsys.readouterr().err
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(jsonl([good, line("b", {"model": "m", "prompt": "x"}, "/v1/completions")]))
    assert main(["plan", "--batch-file", str(mixed)]) == 1
    assert "mixes endpoints" in capsys.readouterr().err
    assert main(["plan", "--batch-file", str(tmp_path / "none.jsonl")]) == 2


def test_targets_get_the_provider_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each --target: online in DAG order (minutes in the given headroom) against its batch
    API, and the choice; an unknown provider exits 2."""
    f = tmp_path / "in.jsonl"
    long = "Label the sentiment of each review by the rules. " * 200
    bodies = [
        {
            **chat_body("A", f"r{i}"),
            "messages": [{"role": "system", "content": long}, {"role": "user", "content": f"r{i}"}],
        }
        for i in range(6)
    ]
    f.write_bytes(jsonl([line(f"r{i}", b) for i, b in enumerate(bodies)]))
    argv = ["plan", "--batch-file", str(f), "--target", "anthropic/claude-sonnet-4-5"]
    assert main([*argv, "--target", "openai/gpt-5", "--tpm", "30000"]) == 0
    out = capsys.readouterr().out
    assert (
        "anthropic/claude-sonnet-4-5: online" in out
        or "anthropic/claude-sonnet-4-5: batch_api" in out
    )
    assert "openai/gpt-5: " in out and "min in the headroom" in out
    assert "breakpoint TTL 1h" in out
    assert main([*argv[:3], "--target", "nowhere/x"]) == 2
