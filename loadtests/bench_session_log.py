"""What the session log costs a request: on the event loop, and on its writer thread.

Every request the gateway sends is journaled twice (``Journal.sent``: its
place in the log and its dispatch record; ``Journal.answered``: the answer),
each a job of the writer thread (``gateway/sessions/writer.py``, group
commit) and back.  This drives the journal in process, as the service loop
calls it, with ``make bench-frontend``'s requests: one of 6 system prompts of
~400 words (~2,600 characters), a fresh 20-word question, a 32-token answer,
a vLLM payload of ~1,130 token ids, ``--concurrency`` requests at once, over a
SQLite log (the default store).  Two shapes: ``new`` (every request a new
conversation, as in the frontend bench) and ``resumed`` (each client's
request extends its conversation: its last question, the answer, a new
question, found again by its prefix; a new conversation after ``--turns``).

Per shape, rounds alternate the same driver without a log (``Journal(None)``)
and with one; the loop's cost of a request is the difference of the loop
thread's CPU (``time.thread_time``) between the two, the writer's its
thread's CPU over the requests, ``checkpoint`` the CPU of the thread that copies the
SQLite log's WAL into its file (``gateway/sessions/checkpoint.py``; 0 in a tree where
the writer did it in its commits).  The loop's figure counts the vLLM payload's
bytes the journal keeps of each request (``vllm_payload``, built for it
alone).  ``wait`` is how long a request waited for its record to be committed
(``Journal.sent``, before it may be sent: part of its TTFT), p50 and p90.

``--busy SHARE`` keeps the event loop busy that share of the time (pure Python
in turns of 4 ms on average, as a gateway's loop is under load) beside the
requests; the spinning's own CPU is not counted in the loop's figure.  There a
record's wait holds the request's turn back through the busy loop, and the
writer's CPU its waits to take the GIL back after each step of the database:
what neither shows on an idle loop.
``--profile`` prints cProfile's top functions of both threads (their own
time).  Prints a table, writes JSON.

    python -m loadtests.bench_session_log --requests 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.core.outputs import Usage
from gateway.service.journal import Journal
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.render import vllm_payload
from gateway.sessions.store import FsyncPolicy, SessionStore
from manifest.sessionlog import Header, MessageEvent

WORDS = (
    "cache block prefix anchor tenant replica token span warm pin lease evict session "
    "log writer commit request answer model engine gateway planner manifest"
).split()
# the resolved sampling of a bench request (engines.base.SamplingOptions, as a dict)
SAMPLING: dict[str, Any] = {
    "max_tokens": 32, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "stop": [], "seed": None,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": True, "n": 1,
    "logprobs": None, "prompt_logprobs": None, "structured": None, "logit_bias": [],
    "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [],
    "include_stop_str_in_output": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "bad_words": [], "allowed_token_ids": None,
    "stream_interval": 32,
}  # fmt: skip
CONFIG = {"max_tokens": 32, "stream": False, "vllm": {"ignore_eos": True}}


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


@dataclass
class Convo:
    """One client's conversation (``resumed``): its system prompt and its turns so far."""

    system: str
    turns: list[MessageEvent]


class Driver:
    """Requests as the service loop journals them (``gateway/service/loop.py``)."""

    def __init__(
        self, shape: str, concurrency: int, turns: int, engine_ms: float, seed: int = 48
    ) -> None:
        rng = random.Random(seed)
        self.engine_s = engine_ms / 1000
        self.systems = [f"You are assistant {i}. " + text(rng, 400) for i in range(6)]
        self.shape, self.concurrency, self.turns = shape, concurrency, turns
        self.convos = [Convo(self.systems[c % 6], []) for c in range(concurrency)]
        self.ids = [rng.randrange(150_000) for _ in range(1130)]
        self.waits: list[float] = []  # seconds each request's record took (Journal.sent)

    def request(self, i: int, client: int) -> tuple[Header, tuple[MessageEvent, ...]]:
        rng = random.Random(i)
        question = MessageEvent("user", f"question {i}: " + text(rng, 18))
        turns: tuple[MessageEvent, ...]
        if self.shape == "new":
            system, turns = self.systems[i % 6], (question,)
        else:
            c = self.convos[client]
            if len(c.turns) >= 2 * self.turns:
                c.turns = []
            c.turns.append(question)
            system, turns = c.system, tuple(c.turns)
        return Header.make("vcache-demo", "local", (system,), None, CONFIG), turns

    def answered(self, client: int, answer: str) -> None:
        if self.shape == "resumed":
            self.convos[client].turns.append(MessageEvent("assistant", answer))

    async def run(self, journal: Journal, requests: int) -> None:
        queue = iter(range(requests))

        async def client(c: int) -> None:
            for i in queue:
                header, turns = self.request(i, c)
                rid = f"req-{i}-{time.monotonic_ns()}"
                op = journal.open("default", header, turns, None)
                if journal.log is not None:  # the bytes the journal keeps of a vLLM request
                    body = vllm_payload(self.ids, None, SAMPLING)  # (LocalPrepared.sent)
                    directives = {"cache_salt": None, "sampling": SAMPLING}
                    t0 = time.perf_counter()
                    await journal.sent(op, rid, "local", "vllm", directives, body)
                    self.waits.append(time.perf_counter() - t0)
                # the engine's turn: requests end apart, as the gateway's do
                await asyncio.sleep(self.engine_s * random.Random(i).uniform(0.5, 1.5))
                answer = text(random.Random(-i), 32)
                self.answered(c, answer)
                await journal.answered(op, rid, answer, Usage.of(1130, 32, 1024))

        await asyncio.gather(*(client(c) for c in range(self.concurrency)))


class Spinner:
    """Keeps the loop busy ``share`` of the time: pure Python for ``share`` of a turn of
    4 ms on average, then a sleep for the rest, each of random length (0.5 to 1.5 times
    its mean: turns of one length would lock into step with the requests' own timers).
    ``cpu_s``: the spinning's own CPU."""

    TURN_S = 0.004

    def __init__(self, share: float, seed: int = 48) -> None:
        self.share = share
        self.cpu_s = 0.0
        self._rng = random.Random(seed)
        self._task: asyncio.Task[None] | None = None

    async def _spin(self) -> None:
        while True:
            busy = self.share * self.TURN_S * self._rng.uniform(0.5, 1.5)
            c0, end = time.thread_time(), time.perf_counter() + busy
            while time.perf_counter() < end:
                sum(range(64))
            self.cpu_s += time.thread_time() - c0
            await asyncio.sleep((1 - self.share) * self.TURN_S * self._rng.uniform(0.5, 1.5))

    def __enter__(self) -> Spinner:
        if self.share > 0:
            self._task = asyncio.get_running_loop().create_task(self._spin())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


def _no_adapter(provider: str) -> Any:
    raise AssertionError(f"no rebuild here ({provider})")


def _thread_cpu(
    name: str, before: set[threading.Thread], optional: bool = False
) -> Callable[[], float]:
    """The CPU seconds so far of the thread named ``name`` started since ``before`` (the
    threads then): another log's writer in this process (tests) is not this one.  No such
    thread: an error, or 0 where it is ``optional`` (a tree before it had one)."""
    t = next((t for t in threading.enumerate() if t.name == name and t not in before), None)
    if t is None:
        if not optional:
            raise LookupError(f"no thread {name!r} was started")
        return lambda: 0.0
    assert t.ident is not None
    clock = time.pthread_getcpuclockid(t.ident)
    return lambda: time.clock_gettime(clock)


def _top(prof: cProfile.Profile, n: int) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


async def _arm(
    driver: Driver,
    requests: int,
    logged: bool,
    folder: Path,
    fsync: FsyncPolicy,
    profile: int,
    busy: float,
) -> dict[str, Any]:
    log = None
    before = set(threading.enumerate())  # the log's writer is the thread it starts
    if logged:
        store = SessionStore(folder / f"log-{time.monotonic_ns()}.db", fsync)
        log = SessionLog(store, Reconstructor(_no_adapter, lambda: None), verify=False)
    journal = Journal(log)
    writer_cpu = _thread_cpu("session-log", before) if log is not None else (lambda: 0.0)
    # the SQLite log's WAL checkpoints (gateway/sessions/checkpoint.py)
    checkpoint_cpu = _thread_cpu("session-log-checkpoint", before, optional=True)
    profs = (cProfile.Profile(), cProfile.Profile()) if profile and log is not None else None
    if profs is not None and log is not None:
        await log.writer.run(profs[1].enable)
        profs[0].enable()
    w0, c0, l0, t0 = writer_cpu(), checkpoint_cpu(), time.thread_time(), time.perf_counter()
    with Spinner(busy) as spinner:
        await driver.run(journal, requests)
    w1, c1, l1, t1 = writer_cpu(), checkpoint_cpu(), time.thread_time(), time.perf_counter()
    loop_s = l1 - l0 - spinner.cpu_s
    out: dict[str, Any] = {
        "loop_s": loop_s,
        "writer_s": w1 - w0,
        "checkpoint_s": c1 - c0,
        "wall_s": t1 - t0,
    }
    if driver.waits:
        q = statistics.quantiles(driver.waits, n=10)
        out["wait_p50_ms"], out["wait_p90_ms"] = q[4] * 1e3, q[8] * 1e3
    if log is not None:
        if profs is not None:
            profs[0].disable()
            await log.writer.run(profs[1].disable)
            print(f"--- loop thread ({driver.shape})\n{_top(profs[0], profile)}")
            print(f"--- writer thread ({driver.shape})\n{_top(profs[1], profile)}")
        out["commits"] = log.writer.commits
        out["jobs"] = log.writer.jobs
        log.close()
    return out


async def run(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    rows = []
    for shape in args.shapes:
        loop_us, writer_us, checkpoint_us, wall = [], [], [], []
        per_commit, w50, w90 = [], [], []
        for r in range(args.rounds):
            driver = Driver(shape, args.concurrency, args.turns, args.engine_ms)
            off = await _arm(driver, args.requests, False, folder, args.fsync, 0, args.busy)
            driver = Driver(shape, args.concurrency, args.turns, args.engine_ms)
            prof = args.profile if r == args.rounds - 1 else 0
            on = await _arm(driver, args.requests, True, folder, args.fsync, prof, args.busy)
            n = args.requests
            loop_us.append((on["loop_s"] - off["loop_s"]) / n * 1e6)
            writer_us.append(on["writer_s"] / n * 1e6)
            checkpoint_us.append(on["checkpoint_s"] / n * 1e6)
            wall.append((on["wall_s"] - off["wall_s"]) / n * 1e6)
            per_commit.append(on["jobs"] / max(on["commits"], 1))
            w50.append(on["wait_p50_ms"])
            w90.append(on["wait_p90_ms"])
        rows.append(
            {
                "shape": shape,
                "requests": args.requests,
                "concurrency": args.concurrency,
                "busy": args.busy,
                "loop_us": statistics.median(loop_us),
                "writer_us": statistics.median(writer_us),
                "checkpoint_us": statistics.median(checkpoint_us),
                "wall_us": statistics.median(wall),
                "jobs_per_commit": statistics.median(per_commit),
                "wait_p50_ms": statistics.median(w50),
                "wait_p90_ms": statistics.median(w90),
                "rounds": {"loop_us": loop_us, "writer_us": writer_us, "wait_p90_ms": w90},
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'shape':<8} {'busy':>4} {'requests':>8} {'loop µs/req':>11} {'writer µs/req':>13} "
        f"{'checkpoint':>10} {'wall µs/req':>11} {'jobs/commit':>11} {'wait p50 ms':>11} "
        f"{'p90':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r['shape']:<8} {r['busy']:>4.2f} {r['requests']:>8} {r['loop_us']:>11.0f} "
            f"{r['writer_us']:>13.0f} {r['checkpoint_us']:>10.0f} {r['wall_us']:>11.0f} "
            f"{r['jobs_per_commit']:>11.1f} "
            f"{r['wait_p50_ms']:>11.2f} {r['wait_p90_ms']:>6.2f}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["new", "resumed"])
    ap.add_argument("--requests", type=int, default=480, help="per round, shape and arm")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--engine-ms", type=float, default=300, help="a request's time in the engine (±50%%)"
    )
    ap.add_argument("--turns", type=int, default=8, help="questions per resumed conversation")
    ap.add_argument("--rounds", type=int, default=3, help="median of these")
    ap.add_argument("--fsync", default="normal", choices=["full", "normal", "off"])
    ap.add_argument(
        "--busy", type=float, default=0.0, help="share of the time the loop is kept busy (0-0.9)"
    )
    ap.add_argument("--profile", type=int, default=0, help="top N functions, last round")
    ap.add_argument("--out", default="bench-session-log.json")
    args = ap.parse_args()
    if not 0 <= args.busy <= 0.9:
        ap.error(f"--busy {args.busy}: a share of the time from 0 to 0.9")
    with tempfile.TemporaryDirectory() as folder:
        rows = asyncio.run(run(args, Path(folder)))
    print(table(rows))
    Path(args.out).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
