"""What the exact index costs the gateway per request, in process: folding a replica's
KV events, and routing (`Dispatcher.route`) with and without the hold.

Folding: batches shaped as vLLM 0.32 publishes them (its own msgspec types,
one batch an engine step), encoded once, then fed through the subscriber's
ordering rules (`EventSequence.receive`: decode) into `KVSync.apply` (the
index).  A request's events: a ``BlockStored`` of its new prompt blocks (128
tokens each, their token ids on the wire), a decode block's ``BlockStored``,
and one single-block ``BlockRemoved`` for each block it allocated once the
cache is full (vLLM evicts one cached block per block it hands out).  Steps
of one request, and of 8 (concurrent requests share an engine step).

Routing: `Dispatcher.route` over one replica whose engine answers the hold in
process (no socket: the engine round trip itself is not in the figure), for the
bench's prompts (6 system prompts of 1,000 tokens and a fresh 130-token question,
block size 128), the index holding 20,000 other blocks.

CPU time (``time.process_time``) per event, batch and request; best of
``--repeat`` runs.  Prints two tables and writes their rows as JSON to ``--out``.

    .venv/bin/python -m loadtests.bench_kv_events [--out bench-kv-events.json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec

from engines.base import GenerateRequest, SamplingOptions
from engines.vllm.kv_stream import EventSequence
from gateway.core.metrics import Metrics
from gateway.local.dispatch import Dispatcher
from gateway.local.kv_sync import KVSync
from gateway.local.leases import LeaseBook
from gateway.local.replica_set import ReplicaSet
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from gateway.local.spans import KVSpans
from manifest.hashing import block_hashes
from manifest.index import LocationId, PrefixIndex

BS = 128
R = LocationId("replica-0")


def _payloads(
    rng: random.Random, per_step: int, new_blocks: int, removals: int, steps: int
) -> tuple[list[bytes], int]:
    """``steps`` encoded batches of ``per_step`` requests' events; with the event count."""
    from vllm.distributed import kv_events as ve

    def stored(n: int) -> Any:
        return ve.BlockStored(
            block_hashes=[rng.getrandbits(64) for _ in range(n)],
            parent_block_hash=rng.getrandbits(64),
            token_ids=[rng.randrange(150_000) for _ in range(n * BS)],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
        )

    enc = msgspec.msgpack.Encoder()
    resident: list[int] = [rng.getrandbits(64) for _ in range(removals * per_step * steps)]
    out: list[bytes] = []
    events = 0
    for _ in range(steps):
        evs: list[Any] = []
        for _ in range(per_step):
            for ev in (stored(new_blocks), stored(1)):  # the prompt's, a decode block's
                evs.append(ev)
                resident.extend(ev.block_hashes)
            evs += [
                ve.BlockRemoved(block_hashes=[resident.pop(0)], medium="GPU", group_idx=0)
                for _ in range(removals)
            ]
        events += len(evs)
        out.append(enc.encode(ve.KVEventBatch(ts=time.time(), events=evs)))
    return out, events


def fold(per_step: int, new_blocks: int, removals: int, steps: int, repeat: int) -> dict[str, Any]:
    """One folding shape's best-of-``repeat`` CPU: its row."""
    rng = random.Random(0)
    payloads, events = _payloads(rng, per_step, new_blocks, removals, steps)
    best = float("inf")
    for _ in range(repeat):
        kv = KVSync(PrefixIndex(), LeaseBook())
        kv.index.apply_stored(R, [rng.getrandbits(64) for _ in range(20_000)])
        seq = EventSequence(functools.partial(kv.apply, R))
        t0 = time.process_time()
        for i, p in enumerate(payloads):
            seq.receive(i, p)
        best = min(best, time.process_time() - t0)
        kv.index.check_integrity()
    requests = per_step * steps
    return {
        "requests_a_step": per_step,
        "blocks_stored_a_request": new_blocks + 1,
        "removals_a_request": removals,
        "events_a_request": events / requests,
        "us_an_event": best / events * 1e6,
        "us_a_batch": best / steps * 1e6,
        "us_a_request": best / requests * 1e6,
    }


class _Engine:
    """An engine core that answers holds at once: its leading resident blocks."""

    ready = True

    def __init__(self, resident: Sequence[bytes]) -> None:
        self.resident = set(resident)
        self.capabilities = SimpleNamespace(max_model_len=2048, block_size=BS)

    async def call_core(self, method: str, *args: Any) -> Any:
        if method == "vcache_hold":
            n = 0
            for h in args[1]:
                if h not in self.resident:
                    break
                n += 1
            return {"held": n, "refused": ""}
        if method == "vcache_release":
            return {"freed": 0}
        raise AssertionError(method)

    def generate(self, request: Any) -> Any:
        raise AssertionError("not used")


async def _route(hold_share: float, requests: int) -> float:
    rng = random.Random(1)
    systems = [[rng.randrange(150_000) for _ in range(1000)] for _ in range(6)]
    shared = [h for s in systems for h in block_hashes(s, BS, "0")]
    engine = _Engine([bytes(h) for h in shared])
    kv = KVSpans(BS, "0", pin_max_share=0.5, default_lease_s=60, holder="bench")
    with tempfile.TemporaryDirectory() as tmp:
        kv.attach(R, engine, f"ipc://{tmp}/events", None)
        kv.index.apply_stored(R, shared)
        kv.index.apply_stored(R, [rng.getrandbits(64) for _ in range(20_000)])
        kv.state(R).agreement = "exact"
        replicas = ReplicaSet([Replica(R, engine)])  # type: ignore[arg-type]
        replicas.booted(kv)
        d = Dispatcher(replicas, Router(), Metrics(), max_inflight=8, hold_share=hold_share)
        greqs = [
            GenerateRequest(
                f"r{i}",
                (*rng.choice(systems), *(rng.randrange(150_000) for _ in range(130))),
                SamplingOptions(max_tokens=32),
            )
            for i in range(requests + 50)
        ]
        t0 = 0.0
        for i, g in enumerate(greqs):
            if i == 50:  # the first ones warm the hash memo
                t0 = time.process_time()
            x = await d.route(g, None)
            d.release(x)
            if x.prefill is not None and x.prefill.hold is not None:
                x.prefill.hold.give()
        spent = time.process_time() - t0
        await kv.close()
    return spent / requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="batches per folding shape")
    ap.add_argument("--requests", type=int, default=2000, help="routed requests per arm")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-kv-events.json"))
    a = ap.parse_args()
    folds: list[dict[str, Any]] = []
    routes: list[dict[str, Any]] = []
    print(
        "| requests a step | blocks stored a request | removals | events a request "
        "| µs an event | µs a batch | µs a request |"
    )
    print("|---|---|---|---|---|---|---|")
    for per_step in (1, 8):
        for new_blocks, removals in ((5, 6), (1, 2)):
            r = fold(per_step, new_blocks, removals, a.steps, a.repeat)
            folds.append(r)
            print(
                f"| {per_step} | {new_blocks} + 1 | {removals} | {r['events_a_request']:.0f} "
                f"| {r['us_an_event']:.1f} | {r['us_a_batch']:.1f} | {r['us_a_request']:.1f} |",
                flush=True,
            )
    print()
    print("| hold | route µs a request (CPU) |")
    print("|---|---|")
    for share in (0.25, 0.0):
        best = min(asyncio.run(_route(share, a.requests)) for _ in range(a.repeat))
        routes.append({"hold_max_share": share, "route_us_a_request": best * 1e6})
        print(f"| {'on (0.25)' if share else 'off'} | {best * 1e6:.1f} |", flush=True)
    a.out.write_text(
        json.dumps({"fold": folds, "route": routes, "args": vars(a)}, default=str, indent=2)
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
