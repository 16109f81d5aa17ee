"""What coming back from idle costs on this machine: one fixed workload, timed in CPU.

    .venv/bin/python -m loadtests.idle_penalty [--gap-ms 12] [--runs 300]

The same work (a walk over ~200k Python objects in a shuffled order: a
working set larger than a core's L2 cache, like a request's trip through a
web framework) is run back to back, then with an idle sleep before each run.
Its CPU time (``time.thread_time``) only counts the work itself, so any
difference is what the machine charges for having been idle: caches gone
cold, a vCPU the host gave to someone else.  A proxy benchmark that sends one
request at a time pays it on every request; one under load does not.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def run(gap_s: float, runs: int, objs: list[dict[str, Any]], order: list[int]) -> list[float]:
    cpu: list[float] = []
    for r in range(runs):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.thread_time()
        total = 0
        for j in range(r * 977, r * 977 + 20_000):
            total += objs[order[j % len(order)]]["k"]
        cpu.append(time.thread_time() - t0)
    return cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gap-ms", type=float, default=12.0, help="idle before each run")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("reports/idle_penalty.json"))
    args = ap.parse_args(argv)
    rng = random.Random(1)
    objs: list[dict[str, Any]] = [{"k": i, "v": str(i)} for i in range(200_000)]
    order = list(range(len(objs)))
    rng.shuffle(order)
    rows = {}
    for label, gap in (("back to back", 0.0), (f"after {args.gap_ms:g} ms idle", args.gap_ms)):
        cpu = run(gap / 1e3, args.runs, objs, order)
        rows[label] = {
            "cpu_ms_p50": statistics.median(cpu) * 1e3,
            "cpu_ms_mean": statistics.fmean(cpu) * 1e3,
        }
    base, idle = (r["cpu_ms_p50"] for r in rows.values())
    print(f"{'the same work':<24}{'CPU ms p50':>12}{'mean':>9}")
    for label, r in rows.items():
        print(f"{label:<24}{r['cpu_ms_p50']:>12.2f}{r['cpu_ms_mean']:>9.2f}")
    print(f"idle penalty: {idle / base - 1:+.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"runs": args.runs, "gap_ms": args.gap_ms, "rows": rows}
    args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
