"""A paused session's lease gives way to a live request on a real vLLM CPU replica.

The replica's KV cache is 24 blocks and its pin budget 0.75 (18).  Session A's
turn ends with a tool call: its prompt's 14 full blocks are leased across the
pause.  Then a request whose prompt and answer need 12 blocks arrives: 10 are
left beside A's pins, and vLLM cannot start a request it has no blocks for (it
would wait until A's lease ran out, up to ``max_lease_s``).  The gateway
releases A's lease first (``SessionTurns.make_room``), and the request is
answered at once.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import ADMIN, ADMIN_KEYS, metric, own_gateway
from tests.integration.test_agent_sessions import FORCED, TOOL, VOCAB

pytestmark = pytest.mark.integration

BLOCK = 128
KV_BYTES = 6 << 20  # 24 blocks of 128 tokens (2 KiB a token with the demo model)
REPLICA = "replica-0"
YIELDED = 'vcache_session_retention_total{outcome="yielded"}'


@pytest.fixture(scope="module")
def url(
    data_dir: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("lease-room")
    args = [
        "--kv-cache-bytes",
        str(KV_BYTES),
        "--replicas",
        "1",
        "--max-model-len",
        "2048",
        "--pin-max-share",
        "0.75",
    ]
    with own_gateway(tmp, data_dir, args, ADMIN_KEYS) as base:
        yield base


def _text(seed: int, words: int) -> str:
    return " ".join(random.Random(seed).choices(VOCAB, k=words))


def _stats(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/v1/cache/stats")
    assert r.status_code == 200, r.text
    return dict(r.json()["replicas"][REPLICA])


def test_a_paused_sessions_lease_gives_way_to_a_request_that_needs_its_blocks(url: str) -> None:
    with httpx.Client(base_url=url, headers=ADMIN, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        a = [
            {"role": "system", "content": "You are a coding agent. " + _text(1, 440)},
            {"role": "user", "content": "Run the unit tests, please."},
        ]
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": a,
                "max_tokens": 40,
                "temperature": 0,
                "tools": [TOOL],
                "tool_choice": FORCED,
            },
            headers={"x-vcache-session": "agent-a"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
        leased = r.json()["usage"]["prompt_tokens"] // BLOCK
        assert 13 <= leased <= 15, leased  # the prompt's full blocks: about 14
        stats = _stats(c)
        assert stats["blocks_pinned"] == leased, stats
        assert metric(url, YIELDED) == 0

        # another prompt: its blocks and its answer's are more than the rest of the cache
        b = [{"role": "user", "content": _text(2, 430)}]
        r = c.post(
            "/v1/chat/completions",
            json={"model": model, "messages": b, "max_tokens": 16, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        need = -(-usage["prompt_tokens"] // BLOCK) + 1
        assert leased + need > KV_BYTES // (2048 * BLOCK), (leased, need)  # it could not fit
        assert metric(url, YIELDED) == 1
        assert _stats(c)["blocks_pinned"] == 0  # A's lease was released for it
