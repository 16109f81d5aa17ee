"""calls_per_request's arithmetic: a request's calls and times as the difference of two
profiled runs, by package, and two runs compared; its loader on a real cProfile file."""

from __future__ import annotations

import cProfile
from pathlib import Path

import pytest

from loadtests.calls_per_request import (
    Fn,
    by_package,
    differences,
    function_name,
    package,
    per_request,
    table,
    totals,
)


def _work(n: int) -> int:
    return sum(_step(i) for i in range(n))


def _step(i: int) -> int:
    return i * 2


def test_a_real_profile_counts_every_call_and_two_runs_difference_is_a_requests(
    tmp_path: Path,
) -> None:
    def profiled(n: int, path: Path) -> None:
        prof = cProfile.Profile()
        prof.runcall(_work, n)
        prof.dump_stats(path)

    profiled(10, tmp_path / "small.prof")
    profiled(30, tmp_path / "large.prof")
    small, large = totals(tmp_path / "small.prof"), totals(tmp_path / "large.prof")
    step = next(k for k in large if k.startswith("_step ("))
    line = _step.__code__.co_firstlineno
    # the path cut where a package of this repository starts (tests/unit/ is not one)
    assert step == f"_step (loadtests/test_calls_per_request.py:{line})"
    assert large[step][0] == 30 and small[step][0] == 10
    rows = {f.name: f for f in per_request(small, large, 20)}
    assert rows[step].calls == pytest.approx(1.0)  # one call of _step a "request"
    work = next(k for k in rows if k.startswith("_work ("))
    assert rows[work].calls == 0.0  # called once in each run: not a request's


def test_the_difference_is_over_the_extra_requests_and_a_function_new_in_the_large_run() -> None:
    small = {"f (gateway/a.py:1)": (100, 0.010, 0.020)}
    large = {"f (gateway/a.py:1)": (500, 0.050, 0.100), "g (vllm/b.py:2)": (40, 0.004, 0.004)}
    rows = per_request(small, large, 400)
    assert [r.name for r in rows] == ["f (gateway/a.py:1)", "g (vllm/b.py:2)"]  # by own time
    f, g = rows
    assert (f.calls, f.own_us, f.cum_us) == pytest.approx((1.0, 100.0, 200.0))
    assert (g.calls, g.own_us) == pytest.approx((0.1, 10.0))


def test_packages_and_names() -> None:
    assert package("Dispatcher.route (gateway/local/dispatch.py:12)") == "gateway"
    assert package("<built-in method builtins.isinstance>") == "built-in"
    assert package("__call__ (enum.py:686)") == "enum.py"
    site = "/v/lib/python3.11/site-packages/zmq/_future.py"
    assert function_name(site, 670, "_handle_events") == "_handle_events (zmq/_future.py:670)"
    stdlib = "/root/.pyenv/versions/3.11.7/lib/python3.11/asyncio/tasks.py"
    assert function_name(stdlib, 9, "sleep") == "sleep (asyncio/tasks.py:9)"
    assert function_name("/work/main/gateway/app.py", 3, "f") == "f (gateway/app.py:3)"
    assert function_name("~", 0, "<built-in method len>") == "<built-in method len>"
    new = "<built-in method __new__ of type object at 0x7fda8b85ea00>"
    assert function_name("~", 0, new) == "<built-in method __new__ of type object>"


def test_by_package_leaves_out_what_is_not_called_a_request() -> None:
    rows = [
        Fn("a (gateway/x.py:1)", 2.0, 30.0, 30.0),
        Fn("b (gateway/y.py:1)", 1.0, 20.0, 20.0),
        Fn("c (zmq/z.py:1)", 3.0, 40.0, 40.0),
        Fn("d (torch/t.py:1)", 0.001, 900.0, 900.0),  # a timer's or an import's: left out
    ]
    assert by_package(rows, 0.5) == [("gateway", 50.0), ("zmq", 40.0)]
    text = table(rows, 0.5, 10)
    assert "3 functions called >= 0.5 times a request: 90 µs" in text and "torch" not in text


def test_two_runs_compared_by_the_largest_difference_of_own_time() -> None:
    before = [Fn("a (g/x.py:1)", 21.0, 60.0, 60.0), Fn("b (g/y.py:1)", 1.0, 10.0, 10.0)]
    after = [Fn("a (g/x.py:1)", 0.0, 0.0, 0.0), Fn("b (g/y.py:1)", 1.0, 12.0, 12.0)]
    after.append(Fn("c (g/z.py:1)", 1.0, 5.0, 5.0))  # new in the second
    after.append(Fn("d (g/w.py:1)", 0.0, 900.0, 900.0))  # startup's, not a request's
    pairs = differences(after, before, 2, min_calls=0.5)
    assert [(a.name, a.own_us, b.own_us) for a, b in pairs] == [
        ("a (g/x.py:1)", 0.0, 60.0),
        ("c (g/z.py:1)", 5.0, 0.0),
    ]
