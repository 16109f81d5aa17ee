"""What the gateway's event loop does a request, function by function, counted.

Sampling (``bench_frontend --profile``) shares a request's time out among
functions; it cannot resolve a change of a few percent, and neither can a bench
run on a host that drifts ±10% a round.  cProfile counts every call: this runs
``vcache serve`` (the demo model, one replica, defaults or an arm of
``bench_frontend``) under cProfile twice, each after the same warm-up, with
``--requests`` N1 and N2 requests of one of ``bench_frontend``'s loads, and
takes the difference over N2 - N1 requests: what one request costs the main
thread (the event loop), startup, warm-up and shutdown cancelled.  Per
function: calls a request (exact, whatever the host does), own and cumulative
µs a request (cProfile's overhead inflates Python functions against C ones, and
the host's state moves them: a run of the inline-render arm, more work on the
loop, measured 20% less in total than the defaults' 12 minutes earlier; compare
calls between runs, times only within one),
then the own time by package.

Functions called less than ``--min-calls`` times a request are left out of the
tables (what the two runs did once each, at different times: imports, timers);
the JSON keeps every row.  ``--compare OTHER.json`` prints, beside this run's,
the calls and own time a request of the functions that differ most from
another run's (a tree before and after a change: ``--checkout``).

    python -m loadtests.calls_per_request --load whole --requests 128,640
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pstats
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from loadtests.bench_frontend import (
    ARMS,
    HERE,
    KV_BYTES,
    LOADS,
    Server,
    _slice,
    _vcache_cmd,
    demo_model,
    gateway_env,
    servers_env,
    short_frame,
    system_prompts,
)
from loadtests.procs import free_port, get_ok, serving

# (calls, own seconds, cumulative seconds) by function
Totals = dict[str, tuple[int, float, float]]

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


@dataclass(frozen=True)
class Fn:
    name: str  # "function (path:line)", the path from its package on
    calls: float  # a request
    own_us: float
    cum_us: float


def function_name(file: str, line: int, func: str) -> str:
    """``func (path:line)``, the path from its package on (site-packages, the stdlib or
    this repository cut off); C functions as cProfile names them."""
    if file == "~":
        return _ADDRESS.sub("", func)  # "<built-in method __new__ of type object at 0x...>"
    return short_frame(f"{func} ({file}:{line})")


def totals(path: Path) -> Totals:
    """A cProfile file's calls, own and cumulative seconds by function."""
    out: Totals = {}
    stats: dict[tuple[str, int, str], tuple[int, int, float, float, object]]
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    for (file, line, func), (_, calls, own, cum, _) in stats.items():
        name = function_name(file, line, func)
        c, o, u = out.get(name, (0, 0.0, 0.0))
        out[name] = (c + calls, o + own, u + cum)
    return out


def per_request(small: Totals, large: Totals, requests: int) -> list[Fn]:
    """What ``requests`` more requests added to each function, a request, by own time."""
    rows = []
    for name, (calls, own, cum) in large.items():
        c0, o0, u0 = small.get(name, (0, 0.0, 0.0))
        rows.append(
            Fn(
                name,
                (calls - c0) / requests,
                (own - o0) / requests * 1e6,
                (cum - u0) / requests * 1e6,
            )
        )
    return sorted(rows, key=lambda f: -f.own_us)


def package(name: str) -> str:
    """The package (or stdlib module) a function's path starts with; C functions are
    ``built-in``."""
    m = re.search(r"\((.*):\d+\)$", name)
    if m is None:
        return "built-in"
    return m.group(1).split("/")[0]


def by_package(rows: Sequence[Fn], min_calls: float) -> list[tuple[str, float]]:
    """Own µs a request by package, of the functions called at least ``min_calls`` times
    a request, largest first."""
    out: dict[str, float] = {}
    for f in rows:
        if f.calls >= min_calls:
            key = package(f.name)
            out[key] = out.get(key, 0.0) + f.own_us
    return sorted(out.items(), key=lambda kv: -kv[1])


def differences(
    rows: Sequence[Fn], other: Sequence[Fn], n: int, min_calls: float = 0.0
) -> list[tuple[Fn, Fn]]:
    """The ``n`` functions called at least ``min_calls`` times a request in either run whose
    own time a request differs most between the two (a function one run lacks counts as
    zero there), each as (this run's, the other's)."""
    mine = {f.name: f for f in rows}
    theirs = {f.name: f for f in other}
    pairs = [
        (mine.get(k, Fn(k, 0.0, 0.0, 0.0)), theirs.get(k, Fn(k, 0.0, 0.0, 0.0)))
        for k in mine.keys() | theirs.keys()
    ]
    pairs = [(a, b) for a, b in pairs if max(a.calls, b.calls) >= min_calls]
    pairs.sort(key=lambda p: -abs(p[0].own_us - p[1].own_us))
    return pairs[:n]


def table(rows: Sequence[Fn], min_calls: float, top: int) -> str:
    shown = [f for f in rows if f.calls >= min_calls]
    total = sum(f.own_us for f in shown)
    lines = [
        f"{len(shown)} functions called >= {min_calls} times a request: "
        f"{total:,.0f} µs own a request (under cProfile)",
        f"{'calls':>8}{'own µs':>9}{'cum µs':>9}  function (by own time)",
    ]
    lines += [f"{f.calls:>8.1f}{f.own_us:>9.1f}{f.cum_us:>9.1f}  {f.name}" for f in shown[:top]]
    lines.append(f"{'own µs':>9}  package")
    lines += [f"{us:>9.1f}  {name}" for name, us in by_package(rows, min_calls)[:top]]
    return "\n".join(lines)


def compared(rows: Sequence[Fn], other: Sequence[Fn], min_calls: float, n: int) -> str:
    def total(fns: Sequence[Fn]) -> float:
        return sum(f.own_us for f in fns if f.calls >= min_calls)

    lines = [
        f"own µs a request of the functions called >= {min_calls} times: "
        f"{total(rows):,.0f} here, {total(other):,.0f} there",
        f"{'calls':>8}{'own µs':>9}{'other calls':>13}{'own µs':>9}  function",
    ]
    for a, b in differences(rows, other, n, min_calls):
        lines.append(f"{a.calls:>8.1f}{a.own_us:>9.1f}{b.calls:>13.1f}{b.own_us:>9.1f}  {a.name}")
    return "\n".join(lines)


# -- the runs ---------------------------------------------------------------------------


def _profiled(args: argparse.Namespace, n: int, work: Path) -> Totals:
    """One gateway under cProfile: the warm-up, ``n`` requests, a clean stop (SIGINT: the
    profile is written on the way out); its totals."""
    out = work / f"calls-{n}.prof"
    port = free_port()
    data_dir = Path(args.data_dir).resolve()
    cmd = _vcache_cmd(data_dir, port, 1, KV_BYTES)
    cmd[1:3] = ["-m", "cProfile", "-o", str(out), "-m", "gateway.cli"]
    source = args.checkout.resolve()
    env = gateway_env(servers_env(), source, work / f"log-{n}.db", args.arm)
    log = work / f"gateway-{n}.log"
    ready = partial(get_ok, f"http://127.0.0.1:{port}/readyz")
    # SIGINT: cProfile writes the profile on the way out of a KeyboardInterrupt
    with serving(cmd, ready, log, env, cwd=source, stop=signal.SIGINT) as proc:
        server = Server("vcache", f"http://127.0.0.1:{port}", proc.pid)
        load, systems = LOADS[args.load], system_prompts()
        asyncio.run(_slice(server, load, range(1_000_000, 1_000_000 + args.warmup), systems))
        got = asyncio.run(_slice(server, load, range(2_000_000, 2_000_000 + n), systems))
        if got.errors:
            raise SystemExit(f"{got.errors} of {n} requests failed; see {log}")
    if not out.exists():
        raise SystemExit(f"no profile written; see {log}")
    return totals(out)


def run(args: argparse.Namespace) -> dict[str, object]:
    small_n, large_n = (int(x) for x in args.requests.split(","))
    if large_n <= small_n:
        raise SystemExit("--requests N1,N2 with N2 > N1")
    demo_model(Path(args.data_dir).resolve())  # built once, before either run
    work = Path(tempfile.mkdtemp(prefix="calls-per-request-"))
    small = _profiled(args, small_n, work)
    large = _profiled(args, large_n, work)
    rows = per_request(small, large, large_n - small_n)
    print(f"{args.load}, {args.arm}, {large_n - small_n} requests ({args.checkout}):")
    print(table(rows, args.min_calls, args.top), flush=True)
    if args.compare is not None:
        other = [Fn(**f) for f in json.loads(args.compare.read_text())["functions"]]
        print(f"against {args.compare}:")
        print(compared(rows, other, args.min_calls, args.top))
    out: dict[str, object] = {
        "load": args.load,
        "arm": args.arm,
        "requests": [small_n, large_n],
        "checkout": str(args.checkout),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "functions": [asdict(f) for f in rows],
        "packages": dict(by_package(rows, args.min_calls)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--load", default="whole", choices=sorted(LOADS))
    ap.add_argument("--arm", default="defaults", choices=sorted(ARMS))
    ap.add_argument("--requests", default="128,640", help="N1,N2: the two runs' requests")
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--min-calls", type=float, default=0.5, help="a request, to be shown")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--checkout", type=Path, default=HERE.parent, help="the tree to run")
    ap.add_argument("--compare", type=Path, default=None, help="another run's JSON")
    ap.add_argument("--data-dir", default=str(HERE.parent / ".vcache-test-data"))
    ap.add_argument("--out", type=Path, default=Path(".bench/calls_per_request.json"))
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
