"""The tier's checks on made-up runs: what counts as a reusable prefix per target, and
when a run passes."""

from __future__ import annotations

from tests.agents.audit import Logged, Reuse, Summary, reuse, table


def _local(rid: str, ids: list[int], cached: int | None) -> Logged:
    return Logged(rid, "local", True, ids, cached, len(ids))


def test_local_prefix_counts_whole_blocks_and_never_the_last_token() -> None:
    a = list(range(300))
    b = [*a, 1000, 1001]  # extends a: 300 shared tokens, 2 whole blocks of 128
    c = list(range(256))  # all of c is in a: its last token is never read (1 block)
    got = reuse([_local("a", a, 0), _local("b", b, 256), _local("c", c, 128)])
    assert got == [Reuse("b", 256, 256), Reuse("c", 128, 128)]


def test_the_longest_shared_prefix_with_any_earlier_request_counts() -> None:
    """A sub-agent's request between two turns of the main conversation."""
    main = list(range(1000))
    sub = [*range(200), *range(5000, 5600)]  # shares 200 tokens (1 block) with main
    main2 = [*main, *range(7000, 7100)]  # shares all of main (7 blocks), not only sub's 1
    got = reuse([_local("m", main, 0), _local("s", sub, 128), _local("m2", main2, 896)])
    assert got == [Reuse("s", 128, 128), Reuse("m2", 896, 896)]
    assert all(r.share == 1.0 for r in got)


def test_anthropic_counts_whole_blocks_from_the_minimum_prefix() -> None:
    big, small = b"x" * 4096, b"y" * 400  # 1024 and 100 emulator tokens
    t = "anthropic/claude-sonnet-4-5"
    first = Logged("1", t, True, [big, small], 0, 1124)
    second = Logged("2", t, True, [big, small, b"z" * 40], 1124, 1134)
    short = Logged("3", t, True, [small, b"w"], 0, 101)
    after_short = Logged("4", t, True, [small, b"v"], 0, 101)
    assert reuse([first, second]) == [Reuse("2", 1124, 1124)]
    assert reuse([short, after_short]) == [Reuse("4", 0, 0)]  # under 1024 tokens: none


def test_openai_counts_its_prefix_cache_steps() -> None:
    t = "openai/gpt-5"
    a = b"a" * (4 * 1500)
    b = a + b"b" * 400
    got = reuse([Logged("1", t, True, a, 0, 1500), Logged("2", t, True, b, 1408, 1600)])
    assert got == [Reuse("2", 1408, 1408)]  # 1024 + 3 steps of 128 <= 1500


def _summary(**kw: object) -> Summary:
    base: dict[str, object] = dict(
        agent="codex",
        version="1",
        target="local",
        model="m",
        exit_codes=[0, 0],
        requests=2,
        ok=2,
        gateway_statuses={"/v1/responses 200": 2},
        failures=[],
        logged=2,
        rebuilt=2,
        reuse=[Reuse("b", 256, 256)],
        predictions=(2, 2),
        system_messages=0,
    )
    return Summary(**(base | kw))  # type: ignore[arg-type]


def test_a_clean_run_passes_and_each_fault_is_named() -> None:
    assert _summary().problems() == []
    assert _summary(exit_codes=[0]).problems() == ["the follow-up step did not run"]
    assert _summary(exit_codes=[0, None]).problems() == ["step 2 timed out"]
    assert _summary(reuse=[Reuse("b", 256, 128)]).problems() == [
        "b read 128 tokens from cache of 256 reusable"
    ]
    assert _summary(reuse=[Reuse("b", 1000, 900)]).problems() == []  # 90% is enough
    assert _summary(rebuilt=1).problems() == ["1 of 2 requests do not rebuild"]
    assert _summary(predictions=(1, 2)).problems() == [
        "the prediction equals vLLM's cached tokens on 1 of 2 requests"
    ]
    fail = {"method": "POST", "path": "/v1/responses", "status": 400, "error": "{...}"}
    assert _summary(failures=[fail]).problems() == ["POST /v1/responses answered 400: {...}"]


def test_the_table_has_one_row_per_run() -> None:
    lines = table([_summary(), _summary(target="emulated", predictions=None)]).splitlines()
    assert len(lines) == 4
    assert lines[2].split() == [
        "codex",
        "1",
        "local",
        "2",
        "2",
        "100.0%",
        "2/2",
        "2/2",
        "0,0",
        "pass",
    ]
    assert lines[3].split()[6] == "-"
