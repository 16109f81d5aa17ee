"""What the HTTP layer costs a generation request, in process: the direct routes
(``gateway/http/direct.py``) against FastAPI's router serving the same routes.

Two gateways built by ``create_app`` over the in-memory engine (``engines.fake``: it
answers at once, so the engine's share is small and the same in both), the demo
model's tokenizer, no keys, no gRPC: ``direct`` as the gateway runs, ``router``
with the direct routes taken out of its middleware (FastAPI's exception middleware,
exit stack, route match and dependency solver serve the same endpoints, as before
them).  Each is driven through ``httpx.ASGITransport`` (no sockets: the HTTP
server's work is not in the figure) by ``--concurrency`` clients, in slices of
``--requests`` requests: each round, for each load, four slices in the order ABBA
(the arms swapped every round), so that a drift (the log and the index grow as
the run goes) falls on both.  Loads: ``chat`` (whole, 32 output tokens),
``chat-stream`` (streamed, the fake engine's reply), ``messages`` (the Messages
API, whole), each over bench_frontend's 6 system prompts of ~400 words and a
fresh question a request; and ``chat-http``, the chat load with each answer replayed
(:class:`Replay`): the HTTP layer alone, without the service and the engine.

The figure is the process's CPU time (``time.process_time``: every thread, the
session log's writer too) per request (the garbage collected before each slice): each arm's
median over the rounds, and the router arm's excess over the direct one in the
same round (median, quartiles, and in how many rounds it was positive).  Prints
a table and writes JSON to ``--out``.

    .venv/bin/python -m loadtests.bench_routes [--rounds 12 --requests 50]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
from fastapi import FastAPI

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import Settings
from gateway.http.direct import DirectRoutes
from loadtests.bench_frontend import MODEL, question, system_prompts

ARMS = ("direct", "router")


def _chat(i: int, systems: list[str], stream: bool) -> tuple[str, dict[str, Any]]:
    messages = [
        {"role": "system", "content": systems[i % len(systems)]},
        {"role": "user", "content": question(i)},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 32, "stream": stream}
    return "/v1/chat/completions", body


def _messages(i: int, systems: list[str]) -> tuple[str, dict[str, Any]]:
    body = {
        "model": MODEL,
        "system": systems[i % len(systems)],
        "messages": [{"role": "user", "content": question(i)}],
        "max_tokens": 32,
    }
    return "/v1/messages", body


LOADS: dict[str, Callable[[int, list[str]], tuple[str, dict[str, Any]]]] = {
    "chat-http": lambda i, s: _chat(i, s, False),
    "chat": lambda i, s: _chat(i, s, False),
    "chat-stream": lambda i, s: _chat(i, s, True),
    "messages": _messages,
}


class Replay:
    """The gateway's service, but each chat answered with the first answer it gave (the
    ``chat-http`` load): what is left is the HTTP layer's work, the body's validation,
    the caller, the answer's serialization."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._answer: Any = None

    async def chat(self, *args: Any, **kw: Any) -> Any:
        if self._answer is None:
            self._answer = await self._real.chat(*args, **kw)
        return self._answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def build(model: str, data_dir: Path, arm: str) -> FastAPI:
    """A gateway over the in-memory engine; ``router``: without the direct routes."""
    engine = FakeEngine(ChatTokenizer.from_pretrained(model), max_model_len=2048)
    settings = Settings(data_dir=data_dir, grpc_port=None, served_model_name=MODEL)
    app = create_app(settings, [engine])
    if arm == "router":
        kept = [m for m in app.user_middleware if cast(object, m.cls) is not DirectRoutes]
        app.user_middleware = kept
    return app


async def _slice(
    client: httpx.AsyncClient, load: str, ids: range, systems: list[str], concurrency: int
) -> float:
    """CPU seconds of the process per request over ``ids``."""
    todo = iter(ids)

    async def worker() -> None:
        for i in todo:
            path, body = LOADS[load](i, systems)
            r = await client.post(path, json=body)
            r.raise_for_status()

    t0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - t0) / len(ids)


async def run(args: argparse.Namespace, model: str, work: Path) -> list[dict[str, Any]]:
    systems = system_prompts()
    apps = {arm: build(model, work / arm, arm) for arm in ARMS}
    per: dict[tuple[str, str], list[float]] = {(a, ld): [] for a in ARMS for ld in args.loads}
    direct, router = apps["direct"], apps["router"]
    async with direct.router.lifespan_context(direct), router.router.lifespan_context(router):
        clients = {
            arm: httpx.AsyncClient(
                transport=httpx.ASGITransport(app=apps[arm]), base_url="http://bench"
            )
            for arm in ARMS
        }
        n = 0
        for load in args.loads:  # warm: the renders' prefixes, the code paths
            for arm in ARMS:
                await _slice(clients[arm], load, range(n, n + args.warmup), systems, 4)
                n += args.warmup
        real = {arm: apps[arm].state.service for arm in ARMS}
        replay = {arm: Replay(real[arm]) for arm in ARMS}
        for rnd in range(args.rounds):
            first, second = ARMS if rnd % 2 == 0 else ARMS[::-1]
            for load in args.loads:
                for arm in ARMS:
                    apps[arm].state.service = replay[arm] if load == "chat-http" else real[arm]
                got: dict[str, float] = dict.fromkeys(ARMS, 0.0)
                for arm in (first, second, second, first):  # ABBA: a drift falls on both
                    ids = range(n, n + args.requests)
                    n += args.requests
                    gc.collect()  # no collection owed by the slice before
                    cpu = await _slice(clients[arm], load, ids, systems, args.concurrency)
                    got[arm] += cpu / 2
                for arm in ARMS:
                    per[(arm, load)].append(got[arm])
                saved = (got["router"] - got["direct"]) * 1e6
                print(
                    f"round {rnd} {load:12s} direct {got['direct'] * 1e6:6.0f} µs CPU/req, "
                    f"router {got['router'] * 1e6:6.0f} ({saved:+.0f})"
                )
        for c in clients.values():
            await c.aclose()
    rows = []
    for load in args.loads:
        d = statistics.median(per[("direct", load)])
        r = statistics.median(per[("router", load)])
        pairs = [b - a for a, b in zip(per[("direct", load)], per[("router", load)], strict=True)]
        q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
        rows.append(
            {
                "load": load,
                "direct_us": round(d * 1e6, 1),
                "router_us": round(r * 1e6, 1),
                "saved_us": round(statistics.median(pairs) * 1e6, 1),
                "saved_iqr_us": [round(q[0] * 1e6, 1), round(q[2] * 1e6, 1)],
                "rounds_router_costlier": sum(x > 0 for x in pairs),
                "router_over_direct": round(r / d, 3),
                "slices_us": {a: [round(x * 1e6, 1) for x in per[(a, load)]] for a in ARMS},
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["load          direct µs/req  router µs/req  saved µs (IQR)      router costlier  ratio"]
    for r in rows:
        lo, hi = r["saved_iqr_us"]
        rounds = f"{r['rounds_router_costlier']}/{len(r['slices_us']['direct'])}"
        out.append(
            f"{r['load']:12s} {r['direct_us']:14.0f} {r['router_us']:14.0f} "
            f"{r['saved_us']:9.0f} ({lo:.0f}..{hi:.0f}) {rounds:>9s} rounds"
            f" {r['router_over_direct']:6.3f}x"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--requests", type=int, default=50, help="per slice (4 a round and load)")
    ap.add_argument("--warmup", type=int, default=50, help="per arm and load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--loads", type=lambda s: s.split(","), default=list(LOADS))
    ap.add_argument("--data-dir", default=".vcache-test-data", help="where the demo model is")
    ap.add_argument("--model", default=None, help="a tokenizer path or hub id (else the demo)")
    ap.add_argument("--out", type=Path, default=Path(".bench/bench_routes.json"))
    args = ap.parse_args(argv)
    if unknown := set(args.loads) - set(LOADS):
        ap.error(f"unknown loads: {', '.join(sorted(unknown))}")
    model = args.model
    if model is None:
        from engines.vllm.demo_model import ensure_demo_model

        model = str(ensure_demo_model(Path(args.data_dir)))
    with tempfile.TemporaryDirectory(prefix="bench-routes-") as work:
        rows = asyncio.run(run(args, model, Path(work)))
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"rows": rows, "args": vars(args) | {"out": str(args.out)}}, indent=2)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
