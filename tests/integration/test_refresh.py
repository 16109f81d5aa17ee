"""A request waiting for its turn keeps the blocks it was predicted to read, on a real
vLLM CPU replica (``cache.refresh_predicted``).

The replica's KV cache is 24 blocks and it runs one request at a time
(``engine.max_num_seqs`` 1: the rest wait in the gateway, the higher priority
first).  Two prompts are answered and their blocks left in the prefix cache,
``older`` first, then ``newer``.  While a long answer runs, a batch request that
shares ``older``'s six-block prefix is routed (predicted: 768 cached tokens)
and waits; an interactive request with a 13-block prompt arrives after it and
goes first.  Its prompt needs more blocks than the cache has never used: vLLM
takes the rest from the least recently used end of its free queue, where
``older``'s blocks were.  Touched when the batch request was routed, they are
now the most recently used, ``newer``'s go instead, and the batch request reads
all 768 tokens.  Without the touch (``VCACHE_CACHE__REFRESH_PREDICTED=false``)
it read 256 of them when written.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import metric, own_gateway, wait_for
from tests.integration.test_agent_sessions import VOCAB

pytestmark = pytest.mark.integration

BLOCK = 128
KV_BYTES = 6 << 20  # 24 blocks of 128 tokens (2 KiB a token with the demo model)
RUNNING = 'vcache_engine_unfinished_requests{replica="replica-0"}'
WAITING = 'vcache_fair_queue_waits_total{replica="replica-0"}'
TOUCHED = 'vcache_kv_refreshed_blocks_total{replica="replica-0",result="touched"}'


@pytest.fixture(scope="module")
def url(
    data_dir: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("refresh")
    args = ["--kv-cache-bytes", str(KV_BYTES), "--replicas", "1", "--max-model-len", "2048"]
    settings = {"VCACHE_ENGINE__MAX_NUM_SEQS": "1"}
    with own_gateway(tmp, data_dir, args, settings) as base:
        yield base


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(VOCAB, k=n))


def _chat(c: httpx.Client, body: dict[str, Any], priority: str = "default") -> httpx.Response:
    r = c.post("/v1/chat/completions", json=body, headers={"x-vcache-priority": priority})
    assert r.status_code == 200, r.text
    r.extensions["answered_at"] = time.monotonic()
    return r


def first_at(r: httpx.Response) -> float:
    return float(r.extensions["answered_at"])


def test_a_waiting_request_keeps_the_blocks_it_was_predicted_to_read(url: str) -> None:
    rng = random.Random(time.time_ns())  # prompts of this run only
    with httpx.Client(base_url=url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]

        def body(system: str, user: str, max_tokens: int = 1) -> dict[str, Any]:
            return {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": user},
                ],
            }

        older = _words(rng, 250)
        r = _chat(c, body(older, "First question?"))
        assert 6 * BLOCK < r.json()["usage"]["prompt_tokens"] < 7 * BLOCK, r.json()["usage"]
        _chat(c, body(_words(rng, 250), "Another question?"))  # newer: used after older
        touched = metric(url, TOUCHED)

        waits = metric(url, WAITING)
        running = body("Count.", "Count to a thousand.", max_tokens=300)
        running |= {"min_tokens": 300}  # it holds the only place for a while
        big = body(_words(rng, 500), "Go.", max_tokens=4)
        later = body(older, "Second question?", max_tokens=4)
        with ThreadPoolExecutor(3) as pool:
            slow = pool.submit(_chat, c, running)
            wait_for(lambda: metric(url, RUNNING) >= 1, timeout_s=60, interval_s=0.02)
            waiting = pool.submit(_chat, c, later, "batch")
            wait_for(lambda: metric(url, WAITING) >= waits + 1, timeout_s=30, interval_s=0.02)
            first = pool.submit(_chat, c, big, "interactive")
            wait_for(lambda: metric(url, WAITING) >= waits + 2, timeout_s=30, interval_s=0.02)
            assert slow.result(timeout=120).json()["usage"]["completion_tokens"] == 300
            done, r = first.result(timeout=120), waiting.result(timeout=120)
            # one place in the engine: the interactive request, sent second, went first
            assert first_at(done) < first_at(r)
        assert done.json()["usage"]["prompt_tokens"] > 12 * BLOCK, done.json()["usage"]
        predicted = int(r.headers["x-vcache-predicted-cached-tokens"])
        assert predicted == 6 * BLOCK, r.headers
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
        assert metric(url, TOUCHED) - touched == 12  # at routing, and after its wait
