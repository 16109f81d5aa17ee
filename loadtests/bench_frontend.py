"""vcache's frontend against vLLM's own OpenAI server on the same model, in one run.

    .venv/bin/python -m loadtests.bench_frontend                  # make bench-frontend
    .venv/bin/python -m loadtests.bench_frontend --rounds 1 --requests 32 --warmup 8  # 2 min
    .venv/bin/python -m loadtests.bench_frontend --arms defaults,no-guard --profile

Two servers of the demo model (CPU engine), both up, taking turns so that only
one serves load at a time: vLLM's own server (``python -m
vllm.entrypoints.openai.api_server --enable-prefix-caching
--enable-prompt-tokens-details --max-model-len 2048``; its KV cache sized and
hashed as the gateway sizes and hashes its own, so the two engines do the same
work) and ``vcache serve`` (its defaults, one embedded replica; ``--arms`` adds
gateways with some of its defaults changed, :data:`ARMS`).  Two loads (issue 48),
each over 6 system prompts of ~400 words and a fresh 20-word question a
request:

- ``streamed``: 64 output tokens, 8 concurrent clients, ``stream: true``;
- ``whole``: 32 output tokens, 16 concurrent clients, whole answers.

Every answer is exactly its output tokens (``ignore_eos``).  Each round runs
a slice of ``--requests`` requests of each load on each server, in an order
reversed every round (the drift of a shared machine falls on all of them).
Per server and load: the frontend's CPU (user + system of the server process
and its descendants other than vLLM's engine processes, from ``/proc``
through psutil: the engine core is a child in both) per request and per output
token, TTFT p50/p90 (the first event with content; for whole answers the
first byte of the answer, which is the answer), e2e p50/p90, output tokens/s
and requests/s, and each gateway's ratios to vLLM's.  Beside them, what tells
a frontend's cost from its engine's: the engine processes' CPU a request (the
same build and model behind both; a difference is what each server asks of its
engine: vcache's scheduler class, KV events, niceness) and a streamed
answer's time a token after its first (TPOT p50: how fast the engine decoded
while the frontend ran beside it).  ``--workers N``:
``vcache serve --workers N --replicas N`` against vLLM's ``--data-parallel-size
N --api-server-count N``.

``--profile``: after the measured rounds, one more slice per server and load
(``--profile-loads``, ``--profile-requests``) with py-spy sampling the frontend
process at 100 Hz, every thread (paused for each sample: ``--nonblocking`` read
the gateway's stacks torn, half its samples with no Python frame above the
loop); the top functions by cumulative and by own share of the samples, each
share as µs per output token and ms per request of that slice's CPU; each
thread's share of the CPU (from ``/proc``) beside its share of the samples, and
the own share by file.  ``--checkout PATH`` runs the gateways from another
source tree, ``--baseline PATH`` adds a gateway from another (a before/after on
one machine, in one run); each server takes ~3 GB with the
default 1 GiB KV cache (``--kv-bytes``), and none starts on a host with less
than ``--min-free-gib`` available.  ``--profile-native``: py-spy's ``--native`` too (C
frames: the event loop's, the socket writes).

Issue 48's targets (:data:`TARGETS`: CPU per output token <= 0.7x vLLM's, TTFT
p90 <= 1.0x, throughput >= 1.0x, on both loads) are checked and printed;
``--check`` exits 1 when one is missed.

Prints a table and writes JSON (``--out``, default ``.bench/bench_frontend.json``;
the py-spy stacks beside it).  Each slice records the host's load average, so a
run on a shared machine can be judged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil

from loadtests.procs import free_port, get_ok, serving
from loadtests.report import percentile
from loadtests.workloads import VOCAB

HERE = Path(__file__).resolve().parent
MODEL = "vcache-demo"
VLLM = "vllm"
KV_BYTES = 1 << 30  # the gateway's KV cache on a CPU host (engines/vllm/engine_config.py)

# a gateway arm -> the settings it changes from vcache serve's defaults (docs/configuration.md)
ARMS: dict[str, dict[str, str]] = {
    "defaults": {},
    # vLLM's own scheduler: the top-priority prefill neither whole nor alone
    "no-top-prefill": {
        "VCACHE_ENGINE__TOP_PREFILL_WHOLE": "false",
        "VCACHE_ENGINE__TOP_PREFILL_ALONE": "false",
    },
    # no first-token guard, so no prefill stops either
    "no-guard": {
        "VCACHE_ENGINE__FIRST_TOKEN_GUARD": "false",
        "VCACHE_ENGINE__PREEMPT_PREFILLS": "false",
    },
    "guard-replica": {"VCACHE_ENGINE__GUARD_SCOPE": "replica"},
    "no-retention": {"VCACHE_CACHE__RETENTION__ENABLED": "false"},
    "verify": {"VCACHE_SESSION_LOG__VERIFY_RECONSTRUCTION": "true"},  # off by default
    # no session log: what journaling every request costs (a deployment's choice, not a default)
    "no-session-log": {"VCACHE_SESSION_LOG__ENABLED": "false"},
    # each engine output read as it comes (one SSE event a step), as vLLM's server does
    "per-output": {"VCACHE_ENGINE__OUTPUT_INTERVAL_MS": "0"},
    # the engine processes not niced below the gateway (vLLM's server does not nice its own)
    "nice0": {"VCACHE_ENGINE__NICE": "0"},
    # no hold of a routed request's predicted blocks in its engine (carried in the request,
    # or a call to the engine core beside a running prefill of them); predictions are then
    # approximate
    "no-hold": {"VCACHE_CACHE__HOLD_MAX_SHARE": "0"},
    # no touch of a routed request's predicted blocks before it is sent (another call to
    # the engine core a warm request, and a turn of the loop)
    "no-refresh": {"VCACHE_CACHE__REFRESH_PREDICTED": "false"},
    "fcfs": {"VCACHE_ENGINE__SCHEDULING_POLICY": "fcfs"},
    # a short render (4,096 characters or fewer to tokenize afresh) on the event loop, not
    # the render thread (engine.render_inline_chars; 0 by default)
    "inline-render": {"VCACHE_ENGINE__RENDER_INLINE_CHARS": "4096"},
    # every scheduler change off: what vLLM alone would schedule
    "plain-scheduler": {
        "VCACHE_ENGINE__TOP_PREFILL_WHOLE": "false",
        "VCACHE_ENGINE__TOP_PREFILL_ALONE": "false",
        "VCACHE_ENGINE__FIRST_TOKEN_GUARD": "false",
        "VCACHE_ENGINE__PREEMPT_PREFILLS": "false",
        "VCACHE_ENGINE__SCHEDULING_POLICY": "fcfs",
    },
}


@dataclass(frozen=True)
class Load:
    stream: bool
    max_tokens: int
    concurrency: int


LOADS: dict[str, Load] = {
    "streamed": Load(stream=True, max_tokens=64, concurrency=8),
    "whole": Load(stream=False, max_tokens=32, concurrency=16),
}


def system_prompts(n: int = 6, words: int = 400, seed: int = 48) -> list[str]:
    """``n`` system prompts of ``words`` words each, the same for every run of a seed."""
    rng = random.Random(seed)
    return [
        f"You are assistant {i} of the vcache manual. " + " ".join(rng.choices(VOCAB, k=words))
        for i in range(n)
    ]


def question(i: int, words: int = 20) -> str:
    """Request ``i``'s question: ``words`` words, never asked before in a run."""
    rng = random.Random(i)
    return f"question {i}: " + " ".join(rng.choices(VOCAB, k=words - 2))


def request_body(i: int, load: Load, systems: Sequence[str]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": load.max_tokens,
        "ignore_eos": True,  # vLLM's extension, served by both: exactly max_tokens
        "messages": [
            {"role": "system", "content": systems[i % len(systems)]},
            {"role": "user", "content": question(i)},
        ],
    }
    if load.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Answer:
    ttft_s: float
    e2e_s: float
    tokens: int
    events: int  # SSE events with content (streamed); 1 for a whole answer


@dataclass
class Slice:
    """One slice of one load on one server: what the client saw and the frontend's CPU."""

    wall_s: float
    cpu_s: float
    cpu_by_pid: dict[int, float]
    answers: list[Answer]
    errors: int
    load_avg: tuple[float, float] = (0.0, 0.0)  # the 1-minute load average before, after
    at: str = ""
    sys_s: float = 0.0  # of cpu_s, in the kernel (system calls: socket writes, wakeups)
    engine_s: float = 0.0  # the engine processes' CPU (core, workers) meanwhile


@dataclass
class Row:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    events_per_request: float = 0.0
    cpu_ms_per_request: float = 0.0
    cpu_us_per_token: float = 0.0
    sys_share: float = 0.0  # of the CPU, in the kernel
    engine_ms_per_request: float = 0.0  # the engine processes' CPU, not the frontend's
    ttft_p50_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    e2e_p50_ms: float = 0.0
    e2e_p90_ms: float = 0.0
    tpot_p50_ms: float = 0.0  # a streamed answer's time a token after its first
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    load_avg_max: float = 0.0
    slices: list[dict[str, Any]] = field(default_factory=list)


def summarize(slices: Sequence[Slice]) -> Row:
    """The slices of one server and load as one row (CPU and wall summed over slices;
    percentiles over every answer)."""
    answers = [a for s in slices for a in s.answers]
    n, tokens = len(answers), sum(a.tokens for a in answers)
    cpu, wall = sum(s.cpu_s for s in slices), sum(s.wall_s for s in slices)
    ttft = [a.ttft_s * 1e3 for a in answers]
    e2e = [a.e2e_s * 1e3 for a in answers]
    tpot = [(a.e2e_s - a.ttft_s) * 1e3 / (a.tokens - 1) for a in answers if a.events > 1]
    return Row(
        requests=n,
        errors=sum(s.errors for s in slices),
        tokens=tokens,
        events_per_request=sum(a.events for a in answers) / n if n else 0.0,
        cpu_ms_per_request=cpu / n * 1e3 if n else 0.0,
        cpu_us_per_token=cpu / tokens * 1e6 if tokens else 0.0,
        sys_share=sum(s.sys_s for s in slices) / cpu if cpu else 0.0,
        engine_ms_per_request=sum(s.engine_s for s in slices) / n * 1e3 if n else 0.0,
        ttft_p50_ms=percentile(ttft, 50) or 0.0,
        ttft_p90_ms=percentile(ttft, 90) or 0.0,
        e2e_p50_ms=percentile(e2e, 50) or 0.0,
        e2e_p90_ms=percentile(e2e, 90) or 0.0,
        tpot_p50_ms=percentile(tpot, 50) or 0.0,
        tokens_per_s=tokens / wall if wall else 0.0,
        requests_per_s=n / wall if wall else 0.0,
        load_avg_max=max((max(s.load_avg) for s in slices), default=0.0),
        slices=[
            {
                "at": s.at,
                "wall_s": s.wall_s,
                "cpu_s": s.cpu_s,
                "tokens": sum(a.tokens for a in s.answers),
                "load_avg": list(s.load_avg),
            }
            for s in slices
        ],
    )


RATIO_KEYS = (
    "cpu_us_per_token",
    "cpu_ms_per_request",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "e2e_p50_ms",
    "tokens_per_s",
)


def ratios(row: Row, base: Row) -> dict[str, float | None]:
    """``row`` over ``base``, key by key (None where ``base`` has nothing to divide by)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        b = getattr(base, key)
        out[key] = getattr(row, key) / b if b else None
    return out


def round_ratios(row: Row, base: Row) -> list[float]:
    """``row``'s CPU a token over ``base``'s, round by round (their slices of one round ran
    back to back, on the host as it was then): how far the host's drift moves the ratio
    the row's totals give."""
    out = []
    for s, b in zip(row.slices, base.slices, strict=False):
        if s.get("tokens") and b.get("tokens") and b["cpu_s"]:
            out.append((s["cpu_s"] / s["tokens"]) / (b["cpu_s"] / b["tokens"]))
    return out


# issue 48's acceptance, vcache's defaults over vLLM's server on every load: ratio key ->
# (the bound, whether the ratio must stay under it)
TARGETS: dict[str, tuple[float, bool]] = {
    "cpu_us_per_token": (0.7, True),
    "ttft_p90_ms": (1.0, True),
    "tokens_per_s": (1.0, False),
}


def misses(rows: Mapping[str, Mapping[str, Row]], gateway: str = "vcache") -> list[str]:
    """Each of :data:`TARGETS` that ``gateway`` misses on a load, said in a line (none:
    every target met)."""
    out = []
    for load, servers in rows.items():
        if gateway not in servers or VLLM not in servers:
            continue
        x = ratios(servers[gateway], servers[VLLM])
        for key, (bound, under) in TARGETS.items():
            v = x[key]
            if v is None or (v > bound if under else v < bound):
                shown = "-" if v is None else f"{v:.2f}x"
                need = "<=" if under else ">="
                out.append(f"{load}: {key} {shown} of vLLM's, the target {need} {bound}x")
    return out


_PHASE_SAMPLE = re.compile(
    r'^vcache_ttft_phase_seconds_(sum|count)\{phase="(\w+)",priority="\w+"\} ([0-9.e+-]+)$'
)


def ttft_phases(metrics: str) -> dict[str, float]:
    """A gateway's ``/metrics`` text: the mean ms of each phase of its local requests' TTFT
    (``vcache_ttft_phase_seconds``, every priority together), in the phases' order."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        m = _PHASE_SAMPLE.match(line)
        if m is not None:
            into = sums if m[1] == "sum" else counts
            into[m[2]] = into.get(m[2], 0.0) + float(m[3])
    return {p: sums[p] * 1e3 / counts[p] for p in sums if counts.get(p)}


def table(rows: Mapping[str, Mapping[str, Row]]) -> str:
    """One line per load and server (``rows[load][server]``), vLLM's first, each gateway's
    ratios to it under it."""
    head = (
        f"{'load':<9}{'server':<24}{'req':>5}{'CPU ms/req':>11}{'µs/tok':>8}"
        f"{'TTFT p50':>9}{'p90':>7}{'e2e p50':>8}{'tok/s':>7}{'ev/req':>7}{'sys%':>5}{'load':>6}"
        f"{'engine ms/req':>14}{'TPOT p50':>9}"
    )
    lines = [head]
    for load, servers in rows.items():
        base = servers.get(VLLM)
        for name in sorted(servers, key=lambda s: (s != VLLM, s)):
            r = servers[name]
            lines.append(
                f"{load:<9}{name:<24}{r.requests:>5}{r.cpu_ms_per_request:>11.2f}"
                f"{r.cpu_us_per_token:>8.0f}{r.ttft_p50_ms:>9.0f}{r.ttft_p90_ms:>7.0f}"
                f"{r.e2e_p50_ms:>8.0f}{r.tokens_per_s:>7.0f}{r.events_per_request:>7.1f}"
                f"{r.sys_share * 100:>5.0f}"
                f"{r.load_avg_max:>6.1f}"
                f"{r.engine_ms_per_request:>14.2f}"
                f"{r.tpot_p50_ms:>9.2f}"
            )
            if base is not None and name != VLLM:
                x = ratios(r, base)
                lines.append(
                    f"{'':<9}{'  ratio to vllm':<24}{'':>5}{_x(x['cpu_ms_per_request']):>11}"
                    f"{_x(x['cpu_us_per_token']):>8}{_x(x['ttft_p50_ms']):>9}"
                    f"{_x(x['ttft_p90_ms']):>7}{_x(x['e2e_p50_ms']):>8}{_x(x['tokens_per_s']):>7}"
                )
                spread = round_ratios(r, base)
                if len(spread) > 1:
                    lines.append(
                        f"{'':<9}{'  CPU/token by round':<24}{'':>5}"
                        f" {min(spread):.2f}-{max(spread):.2f}x,"
                        f" median {statistics.median(spread):.2f}x"
                    )
            if r.errors:
                lines.append(f"{'':<9}  {r.errors} requests failed")
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


# -- the profile ------------------------------------------------------------------------

_LINE = re.compile(r":\d+\)$")
# where a source path's package starts: site-packages, the stdlib, a checkout of this
# repository (its packages' names)
_ROOTS = (
    re.compile(r"\(\S*site-packages/"),
    re.compile(r"\(\S*/lib/python3\.\d+/"),
    re.compile(r"\(\S*?/(?=(?:gateway|engines|manifest|loadtests)/)"),
)
_THREAD = "thread ("  # py-spy --threads: each stack's root, "thread (tid): name"


def short_frame(frame: str) -> str:
    """``func (path...)`` with the path from its package on (site-packages, the stdlib or
    a checkout of this repository cut off)."""
    for root in _ROOTS:
        m = root.search(frame)
        if m:
            return frame[: m.start() + 1] + frame[m.end() :]
    return frame


def _frame(frame: str) -> str:
    """``func (path:line)`` as ``func (path)``, the path from its package on."""
    return short_frame(_LINE.sub(")", frame.strip()))


def stacks(collapsed: Iterable[str]) -> list[tuple[list[str], int]]:
    """py-spy's collapsed stacks (``frame;frame;... count`` a line, root first) as frames
    without line numbers, and counts; lines that are not stacks are skipped."""
    out = []
    for line in collapsed:
        stack, _, count = line.rstrip().rpartition(" ")
        frames = [_frame(f) for f in stack.split(";") if f]
        if frames and count.isdigit():
            out.append((frames, int(count)))
    return out


@dataclass(frozen=True)
class Cost:
    function: str
    cumulative: float  # share of the samples with it on the stack
    own: float  # share of the samples with it on top


def top_costs(collapsed: Iterable[str], n: int = 30) -> tuple[int, list[Cost]]:
    """The number of samples and the ``n`` functions with the largest cumulative share.
    Of functions on exactly the same stacks (a chain of callers, each calling only the
    next: the interpreter's, the server's, a thread's bootstrap) only the innermost is
    listed; a thread's root (``--threads``) is not a function."""
    total = 0
    cum: Counter[str] = Counter()
    own: Counter[str] = Counter()
    where: dict[str, set[int]] = {}
    depth: dict[str, int] = {}
    for i, (frames, k) in enumerate(stacks(collapsed)):
        frames = [f for f in frames if not f.startswith(_THREAD)]
        if not frames:
            continue
        total += k
        for d, f in enumerate(frames):
            if i not in where.setdefault(f, set()):
                where[f].add(i)
                cum[f] += k
            depth[f] = max(depth.get(f, 0), d)
        own[frames[-1]] += k
    if not total:
        return 0, []
    chains: dict[frozenset[int], str] = {}
    for f in cum:
        key = frozenset(where[f])
        if key not in chains or depth[f] > depth[chains[key]]:
            chains[key] = f
    ranked = sorted(chains.values(), key=lambda f: (-cum[f], f))[:n]
    return total, [Cost(f, cum[f] / total, own[f] / total) for f in ranked]


def own_by_file(collapsed: Iterable[str], n: int = 20) -> list[tuple[str, float]]:
    """The share of the samples on top in each source file, largest first."""
    files: Counter[str] = Counter()
    for frames, k in stacks(collapsed):
        top = frames[-1]
        files[top[top.find("(") + 1 : -1] if "(" in top else top] += k
    total = sum(files.values())
    return [(f, c / total) for f, c in files.most_common(n)] if total else []


def by_thread(collapsed: Iterable[str]) -> list[tuple[str, float]]:
    """The share of the samples in each thread (by name; ``--threads`` stacks), largest
    first; stacks without a thread root count as ``?``."""
    threads: Counter[str] = Counter()
    for frames, k in stacks(collapsed):
        root = frames[0]
        threads[root.partition(": ")[2] or "?" if root.startswith(_THREAD) else "?"] += k
    total = sum(threads.values())
    return [(t, c / total) for t, c in threads.most_common()] if total else []


def thread_cpu(
    before: Mapping[int, float], after: Mapping[int, float], names: Mapping[int, str]
) -> list[tuple[str, float]]:
    """Each thread's share of the CPU the process spent between two readings of its
    threads' CPU seconds (by thread id; from ``/proc``), named as py-spy named it (a thread
    it never saw in Python, e.g. a native library's, by its id), largest first."""
    spent = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    total = sum(v for v in spent.values() if v > 0)
    shares: dict[str, float] = {}
    for tid, v in spent.items():
        if v > 0:
            name = names.get(tid, f"thread {tid}")
            shares[name] = shares.get(name, 0.0) + v / total
    return sorted(shares.items(), key=lambda x: -x[1])


def thread_names(collapsed: Iterable[str]) -> dict[int, str]:
    """The thread ids and names of py-spy's ``--threads`` stacks."""
    out: dict[int, str] = {}
    for frames, _ in stacks(collapsed):
        m = re.match(r"thread \((\d+)\): (.*)", frames[0])
        if m:
            out[int(m.group(1))] = m.group(2)
    return out


def profile_text(
    name: str,
    load: str,
    collapsed: list[str],
    us_per_token: float,
    ms_per_request: float,
    threads: Sequence[tuple[str, float]] = (),
) -> str:
    """The top functions of one profiled slice, each share also as CPU per output token
    and per request of that slice; the shares by thread (of the CPU, ``threads``, and of
    the samples: a thread ready to run but waiting for a core is sampled too) and by
    file."""
    total, costs = top_costs(collapsed)
    lines = [
        f"{name}, {load}: {total} samples; frontend CPU {us_per_token:.0f} µs per output "
        f"token, {ms_per_request:.2f} ms per request",
        f"{'cum %':>6}{'own %':>7}{'µs/tok':>8}{'ms/req':>8}  function (cumulative)",
    ]
    for c in costs:
        lines.append(
            f"{c.cumulative * 100:>6.1f}{c.own * 100:>7.1f}{c.cumulative * us_per_token:>8.1f}"
            f"{c.cumulative * ms_per_request:>8.2f}  {c.function}"
        )
    sampled = dict(by_thread(collapsed))
    lines.append(f"{'CPU %':>6}{'samples %':>10}  thread")
    for t, share in threads or [(t, float("nan")) for t in sampled]:
        lines.append(f"{share * 100:>6.1f}{sampled.get(t, 0.0) * 100:>10.1f}  {t}")
    lines.append("own share by file:")
    lines += [f"{share * 100:>6.1f}  {path}" for path, share in own_by_file(collapsed)]
    return "\n".join(lines)


# -- processes --------------------------------------------------------------------------


def is_engine(name: str, cmdline: str) -> bool:
    """A vLLM engine process (``VLLM::EngineCore``, ``VLLM::Worker``, the DP coordinator)
    or multiprocessing's resource tracker: not the frontend's.  ``VLLM::APIServer_N`` is
    one of ``--api-server-count``'s frontends."""
    vllm_engine = name.startswith("VLLM") and not name.startswith("VLLM::APIServer")
    return vllm_engine or "resource_tracker" in cmdline


def process_cpu(pid: int) -> tuple[dict[int, tuple[float, float]], float]:
    """CPU seconds (user, system) of ``pid`` and of each descendant that is not an engine
    process; and the engine processes' CPU seconds, summed."""
    out: dict[int, tuple[float, float]] = {}
    engines = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            if p is not root and is_engine(p.name(), " ".join(p.cmdline())):
                engines += float(t.user) + float(t.system)
            else:
                out[p.pid] = (float(t.user), float(t.system))
        except psutil.NoSuchProcess:
            continue
    return out, engines


@dataclass
class Server:
    name: str
    url: str
    pid: int
    slices: dict[str, list[Slice]] = field(default_factory=dict)


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool
) -> Answer:
    t0 = time.perf_counter()
    first: float | None = None
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        if not stream:
            raw = await r.read()
            first = time.perf_counter() - t0
            tokens = int(json.loads(raw)["usage"]["completion_tokens"])
            return Answer(first, time.perf_counter() - t0, tokens, 1)
        events, last = 0, b""
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            last = line
            if b'"content":"' in line and b'"content":""' not in line:
                events += 1
                if first is None:
                    first = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    usage = json.loads(last[6:]).get("usage") or {}
    return Answer(first if first is not None else e2e, e2e, int(usage["completion_tokens"]), events)


async def _slice(server: Server, load: Load, ids: range, systems: Sequence[str]) -> Slice:
    todo = iter(ids)
    answers: list[Answer] = []
    errors = 0
    url = f"{server.url}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=load.concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def client() -> None:
            nonlocal errors
            for i in todo:
                try:
                    answers.append(
                        await _one(session, url, request_body(i, load, systems), load.stream)
                    )
                except (RuntimeError, aiohttp.ClientError, KeyError, ValueError) as e:
                    errors += 1
                    if errors <= 3:
                        print(f"{server.name}: {e}", file=sys.stderr, flush=True)

        before_load = os.getloadavg()[0]
        at = time.strftime("%H:%M:%S", time.gmtime())
        before, engines_before = process_cpu(server.pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(load.concurrency)))
        wall = time.perf_counter() - t0
        after, engines_after = process_cpu(server.pid)
    user = {pid: u - before.get(pid, (0.0, 0.0))[0] for pid, (u, _) in after.items()}
    system = {pid: v - before.get(pid, (0.0, 0.0))[1] for pid, (_, v) in after.items()}
    by_pid = {pid: user[pid] + system[pid] for pid in after}
    loads = (before_load, os.getloadavg()[0])
    return Slice(
        wall,
        sum(by_pid.values()),
        by_pid,
        answers,
        errors,
        loads,
        at,
        sum(system.values()),
        engines_after - engines_before,
    )


def _vllm_cmd(model: Path, port: int, workers: int, kv_bytes: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL,
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        "2048",
        # the engine as the gateway configures its own: the same KV size and block hashes
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--prefix-caching-hash-algo",
        "sha256_cbor",
    ]
    if workers > 1:
        cmd += ["--data-parallel-size", str(workers), "--api-server-count", str(workers)]
        # the deprecated api_server module runs one frontend whatever --api-server-count
        # says; vllm serve runs that many (run_multi_api_server)
        cmd[1:3] = ["-c", VLLM_SERVE]
    return cmd


# ``vllm serve`` without its console script (vllm.entrypoints.cli.main reads the package's
# metadata for --version, and a vLLM built from source into a venv may have none)
VLLM_SERVE = """
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser

cli_env_setup()
args = make_arg_parser(FlexibleArgumentParser()).parse_args()
validate_parsed_serve_args(args)
ServeSubcommand.cmd(args)
"""


def _vcache_cmd(data_dir: Path, port: int, workers: int, kv_bytes: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--data-dir",
        str(data_dir),
        "--replicas",
        str(workers),
        "--workers",
        str(workers),
        "--kv-cache-bytes",
        str(kv_bytes),
    ]


def demo_model(data_dir: Path) -> Path:
    """The demo model's path, built by ``vcache demo-model`` if this data dir has none."""
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo-model", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def _threads(pid: int) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def _profile(
    server: Server, load_name: str, ids: range, systems: Sequence[str], out: Path, native: bool
) -> tuple[Slice, list[str], list[tuple[str, float]]]:
    """One slice with py-spy sampling the frontend process: the slice, the collapsed
    stacks, each thread's share of the CPU."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = out / f"pyspy-{server.name}-{load_name}.txt"
    cmd = [spy, "record", "--pid", str(server.pid), "--rate", "100", "--threads"]
    cmd += ["--native"] if native else []
    proc = subprocess.Popen(
        [*cmd, "--format", "raw", "-o", str(raw)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # py-spy attached
    before = _threads(server.pid)
    got = asyncio.run(_slice(server, LOADS[load_name], ids, systems))
    after = _threads(server.pid)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    collapsed = raw.read_text().splitlines() if raw.exists() else []
    return got, collapsed, thread_cpu(before, after, thread_names(collapsed))


def _room(gib: float) -> None:
    """Refuse to start another server on a host with less than ``gib`` GiB available (each
    of them, engine included, takes about 2 GiB and its KV cache)."""
    free = psutil.virtual_memory().available / (1 << 30)
    if free < gib:
        raise SystemExit(f"{free:.1f} GiB available, under --min-free-gib {gib}: no more servers")


def servers_env() -> dict[str, str]:
    """The servers' environment: this shell's without its ``VCACHE_`` settings (each
    gateway runs its defaults or its arm's), this checkout importable, a fixed hash seed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    return {**env, "PYTHONPATH": str(HERE.parent), "PYTHONHASHSEED": "0"}


def gateway_env(env: dict[str, str], source: Path, session_log: Path, arm: str) -> dict[str, str]:
    """One gateway's environment: ``env``, the source tree it runs from, a session log of
    its own, its arm's settings."""
    return {
        **env,
        "PYTHONPATH": str(source),
        "VCACHE_LOG_LEVEL": "warning",
        "VCACHE_SESSION_LOG__PATH": str(session_log),
        **ARMS[arm],
    }


def _servers(
    stack: contextlib.ExitStack, args: argparse.Namespace, work: Path, env: dict[str, str]
) -> list[Server]:
    """vLLM's server, then one gateway per arm (from ``--checkout``), each up and ready."""
    data_dir = Path(args.data_dir).resolve()
    port = free_port()
    ready = partial(get_ok, f"http://127.0.0.1:{port}/v1/models")
    _room(args.min_free_gib)
    cmd = _vllm_cmd(demo_model(data_dir), port, args.workers, args.kv_bytes)
    proc = stack.enter_context(serving(cmd, ready, work / "vllm.log", env))
    servers = [Server(VLLM, f"http://127.0.0.1:{port}", proc.pid)]
    gateways = [
        ("vcache" if arm == "defaults" else f"vcache:{arm}", arm, args.checkout.resolve())
        for arm in args.arms.split(",")
    ]
    if args.baseline is not None:
        gateways.append(("vcache@baseline", "defaults", args.baseline.resolve()))
    for name, arm, source in gateways:
        port = free_port()
        tag = name.replace(":", "-").replace("@", "-")
        own = gateway_env(env, source, work / f"{tag}.db", arm)
        ready = partial(get_ok, f"http://127.0.0.1:{port}/readyz")
        _room(args.min_free_gib)
        cmd = _vcache_cmd(data_dir, port, args.workers, args.kv_bytes)
        log = work / f"{tag}.log"
        proc = stack.enter_context(serving(cmd, ready, log, own, cwd=source))
        servers.append(Server(name, f"http://127.0.0.1:{port}", proc.pid))
    return servers


def _rounds(servers: list[Server], args: argparse.Namespace, systems: Sequence[str]) -> int:
    """The warm-up, then ``--rounds`` rounds of a slice of each load on each server;
    returns the next request id."""
    loads = args.loads.split(",")
    n = 1_000_000  # request ids: every question fresh
    for s in servers:  # not counted: the system prompts cached, every path warm
        for name in loads:
            asyncio.run(_slice(s, LOADS[name], range(n, n + args.warmup), systems))
            n += args.warmup
    for rnd in range(args.rounds):
        for name in loads:
            for s in servers if rnd % 2 == 0 else servers[::-1]:
                got = asyncio.run(_slice(s, LOADS[name], range(n, n + args.requests), systems))
                n += args.requests
                s.slices.setdefault(name, []).append(got)
                ms = got.cpu_s * 1e3 / max(1, len(got.answers))
                print(
                    f"{got.at} round {rnd} {name:<8} {s.name:<22} {ms:6.2f} CPU ms/req "
                    f"{got.wall_s:5.1f} s, load {got.load_avg[1]:.2f}",
                    flush=True,
                )
    return n


def _phases(s: Server) -> dict[str, float]:
    """Where the gateway's TTFT went, by phase (every request it served so far)."""
    text = httpx.get(f"{s.url}/metrics", timeout=10).text
    phases = ttft_phases(text)
    shown = "  ".join(f"{p} {ms:.1f}" for p, ms in phases.items())
    print(f"{s.name}: TTFT by phase, mean ms: {shown}", flush=True)
    return phases


def _profiles(
    servers: list[Server], args: argparse.Namespace, systems: Sequence[str], n: int
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    size = args.profile_requests
    for name in args.profile_loads.split(","):
        for s in servers:
            ids = range(n, n + size)
            got, collapsed, threads = _profile(
                s, name, ids, systems, args.out.parent, args.profile_native
            )
            n += size
            row = summarize([got])
            text = profile_text(
                s.name, name, collapsed, row.cpu_us_per_token, row.cpu_ms_per_request, threads
            )
            print(text, flush=True)
            total, costs = top_costs(collapsed)
            out[f"{s.name} {name}"] = {
                "samples": total,
                "cpu_us_per_token": row.cpu_us_per_token,
                "cpu_ms_per_request": row.cpu_ms_per_request,
                "top": [asdict(c) for c in costs],
                "thread_cpu": threads,
                "thread_samples": by_thread(collapsed),
                "own_by_file": own_by_file(collapsed),
                "text": text,
            }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-frontend-"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = servers_env()
    systems = system_prompts()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with contextlib.ExitStack() as stack:
        servers = _servers(stack, args, work, env)
        print(f"servers up: {', '.join(s.name for s in servers)}; logs in {work}", flush=True)
        n = _rounds(servers, args, systems)
        phases = {s.name: _phases(s) for s in servers if s.name != VLLM}
        profiles = _profiles(servers, args, systems, n) if args.profile else {}
    loads = args.loads.split(",")
    rows = {name: {s.name: summarize(s.slices.get(name, [])) for s in servers} for name in loads}
    print(table(rows))
    missed = misses(rows)
    print("issue 48's targets: " + ("met" if not missed else "missed: " + "; ".join(missed)))
    out: dict[str, Any] = {
        "missed_targets": missed,
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "checkout": str(args.checkout.resolve()),
        "baseline": str(args.baseline.resolve()) if args.baseline else None,
        "workers": args.workers,
        "kv_bytes": args.kv_bytes,
        "requests_per_slice": args.requests,
        "rounds": args.rounds,
        "loads": {k: asdict(LOADS[k]) for k in loads},
        "rows": {load: {s: asdict(r) for s, r in by.items()} for load, by in rows.items()},
        "ratios": {
            load: {s: ratios(r, by[VLLM]) for s, r in by.items() if s != VLLM}
            for load, by in rows.items()
        },
        "cpu_per_token_by_round": {
            load: {s: round_ratios(r, by[VLLM]) for s, r in by.items() if s != VLLM}
            for load, by in rows.items()
        },
        "ttft_phases_ms": phases,
        "profiles": profiles,
        "table": table(rows),
    }
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=64, help="requests per slice")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=16, help="requests per server and load")
    ap.add_argument("--loads", default="streamed,whole", help=f"of {', '.join(LOADS)}")
    ap.add_argument(
        "--arms", default="defaults", help=f"gateways, comma-separated, of {', '.join(ARMS)}"
    )
    ap.add_argument(
        "--check", action="store_true", help="exit 1 when vcache misses issue 48's targets"
    )
    ap.add_argument("--workers", type=int, default=1, help="gateway workers = replicas")
    ap.add_argument("--profile", action="store_true", help="py-spy each frontend after")
    ap.add_argument("--profile-loads", default="streamed")
    ap.add_argument("--profile-native", action="store_true", help="py-spy --native")
    ap.add_argument("--profile-requests", type=int, default=192, help="per profiled slice")
    ap.add_argument(
        "--checkout",
        type=Path,
        default=HERE.parent,
        help="the source tree the gateways run from (its gRPC stubs generated)",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="one more gateway, vcache@baseline (defaults), from this source tree",
    )
    ap.add_argument(
        "--kv-bytes", type=int, default=KV_BYTES, help="each engine's KV cache (both servers)"
    )
    ap.add_argument("--min-free-gib", type=float, default=4.0, help="to start another server")
    ap.add_argument("--data-dir", default=str(HERE.parent / ".vcache-test-data"))
    ap.add_argument("--out", type=Path, default=Path(".bench/bench_frontend.json"))
    args = ap.parse_args(argv)
    if unknown := set(args.arms.split(",")) - set(ARMS):
        ap.error(f"unknown arms: {', '.join(sorted(unknown))}")
    if unknown := (set(args.loads.split(",")) | set(args.profile_loads.split(","))) - set(LOADS):
        ap.error(f"unknown loads: {', '.join(sorted(unknown))}")
    signal.signal(signal.SIGTERM, _stop)  # the servers are stopped on the way out
    out = run(args)
    return 1 if args.check and out["missed_targets"] else 0


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
