"""Recall (M4) on a hosted target, through the provider emulator: a batch resumed after
a restart whose parent item was answered by the gateway before it (its prefix cold at
the provider), with recall on and three items extending the parent's whole prompt.
The real cost gate passes for them (k·u·(1 - r) > P·r: 3 siblings of ~400 new tokens
each over a ~1,650-token parent), so the runner replays the parent's prompt as a warm
(one output token, no item's answer) before they are sent, and each of them reads the
parent's prefix from the provider's cache.  Without recall the first of them prefills
it fresh (the test fails: three requests, no replay)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from engines.tokenizer import ChatTokenizer
from gateway.batches.store import BatchStore, BatchUsage, NewItem
from tests.providers.conftest import KEY, MANUAL, MODELS, Emulator, make_gateway

TARGET = f"openai/{MODELS['openai']}"
CHAT = "/v1/chat/completions"
LONG = "Tell me the whole story of that section again, in detail. " * 40  # u: ~400 tokens


def _body(*turns: str) -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": MANUAL}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": TARGET, "max_tokens": 8, "messages": messages}


def test_a_resumed_batchs_cold_parent_is_replayed_once_for_its_children(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    emulator.admin("reset")
    db = tmp_path / "sessions.db"
    store = BatchStore(db.parent / "batches.db")
    bodies = [_body("q")] + [_body("q", "a", f"{LONG} ({n})") for n in range(3)]
    items = [NewItem(f"i{n}", json.dumps(b)) for n, b in enumerate(bodies)]
    bid = store.create("openai", "t", "key", CHAT, TARGET, items, window_s=3600).id
    assert store.claim(bid, 0, "old-gateway", 60)  # answered before the restart
    assert store.finish(bid, 0, "old-gateway", True, 200, {"request_id": "r0"}, BatchUsage())
    store.close()

    batches = {"recall": True, "poll_s": 0.05}
    session_log = {"path": str(db), "verify_reconstruction": True}
    for gw in make_gateway(emulator, tokenizer, batches=batches, session_log=session_log):
        headers = {"authorization": f"Bearer {KEY}"}
        deadline = time.monotonic() + 30
        while (b := gw.http.get(f"/v1/batches/{bid}", headers=headers).json())[
            "status"
        ] != "completed":
            assert time.monotonic() < deadline, b
            time.sleep(0.05)
        metrics = gw.http.get("/metrics").text
        assert b["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
        out = gw.http.get(f"/v1/files/{b['output_file_id']}/content", headers=headers)
        answers = [json.loads(x) for x in out.text.splitlines()]
    sent = [r for r in emulator.received() if r["path"] == "/v1/chat/completions"]
    assert len(sent) == 4  # the replay, then the three children
    assert sent[0]["size"] < min(r["size"] for r in sent[1:])  # the parent's prompt first
    assert 'vcache_batch_recall_total{decision="replay"} 1.0' in metrics
    # the measured cost: the replay bought the parent's prompt, the children read
    measured = {
        kind: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('vcache_batch_recall_tokens_total{decision="replay"')
        for kind in ("replay_cost", "saving", "replay_cost_measured", "saving_measured")
        if f'kind="{kind}"' in line
    }
    print(f"\nrecall measured: {measured}")
    assert measured["replay_cost_measured"] > 1000 and measured["saving_measured"] > 3000
    cached = {
        a["custom_id"]: a["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        for a in answers
        if a["custom_id"] != "i0"  # answered before the restart: no line of this run's
    }
    print(f"\nchildren's cached tokens after the replay: {cached}")
    # every child reads the replayed prefix; prefilled fresh, the first would read nothing
    assert set(cached) == {"i1", "i2", "i3"} and min(cached.values()) > 1000
