"""An image-bearing agent conversation on the demo vision model (``vcache serve --demo
vision``, one vLLM CPU replica with a small KV cache) through the Messages API, driven by
the official ``anthropic`` SDK.

Twelve turns, a screenshot (a PNG of its own) every third turn: the first in the user's
request, the others in the tool's result.  ``tool_choice`` names the tool, so every turn
ends in a tool call and the session's KV (``metadata.user_id``'s session) is leased on
its replica across the pause.  During each pause other traffic fills the KV cache with
unrelated prompts, more than the blocks the lease leaves; an unleased image conversation
sent before the first pause is evicted by it.  From the second turn on at least 95% of the
previous turn's prompt is read from cache, image blocks included, and every turn's
``x-vcache-predicted-cached-tokens`` equals vLLM's ``cache_read_input_tokens``.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from PIL import Image

from tests.integration.conftest import ADMIN, ADMIN_KEY, ADMIN_KEYS, own_gateway

pytestmark = pytest.mark.integration

MODEL = "demo-vision"
BLOCK = 128  # vLLM's CPU block size
KV_BYTES = 24 << 20  # 96 blocks of 128 tokens (2 KiB a token with the demo decoder)
REPLICA = "replica-0"
TURNS = 12
SHOT_EVERY = 3
# screenshots of their own sizes (4 x 3, 4 x 3, 4 x 2 and 3 x 4 tiles: 208 to 144 tokens)
SIZES = [(640, 400), (800, 600), (1024, 512), (300, 400)]
FLOOD_WORDS = 540  # one flood prompt: about 14 blocks
FLOODS = 7  # per pause: more blocks than the cache leaves beside the session's lease
WORDS = ["window", "button", "cursor", "click", "menu", "panel", "field", "scroll", "tab"]
TOOL: Any = {
    "name": "computer",
    "description": "Act on the screen: take a screenshot, click or type.",
    "input_schema": {
        "type": "object",
        "properties": {"action": {"enum": ["screenshot", "click", "type"]}},
        "required": ["action"],
        "additionalProperties": False,
    },
}
FORCED: Any = {"type": "tool", "name": "computer"}


@pytest.fixture(scope="module")
def url(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("vision-agent")
    args = [
        "--demo",
        "vision",
        "--replicas",
        "1",
        "--kv-cache-bytes",
        str(KV_BYTES),
        "--max-model-len",
        "8192",
    ]
    with own_gateway(tmp, data_dir, args, ADMIN_KEYS) as base:
        yield base


def _words(seed: int, n: int) -> str:
    return " ".join(random.Random(seed).choices(WORDS, k=n))


def _screenshot(i: int) -> dict[str, Any]:
    """Screenshot ``i``: a PNG of its own size and pixels, as an image block."""
    w, h = SIZES[i]
    img = Image.new("RGB", (w, h), (30 + 40 * i, 90, 200 - 30 * i))
    rnd = random.Random(i)
    for _ in range(400):
        img.putpixel((rnd.randrange(w), rnd.randrange(h)), (rnd.randrange(256), 0, 0))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def _prompt(u: Any) -> int:
    return int(
        u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    )


@dataclass
class Turn:
    read: int  # cache_read_input_tokens
    predicted: int  # x-vcache-predicted-cached-tokens
    prompt: int  # the whole prompt's tokens
    pinned: int  # blocks pinned on the replica after the turn


def _pinned(admin: httpx.Client) -> int:
    r = admin.get("/v1/cache/stats")
    assert r.status_code == 200, r.text
    return int(r.json()["replicas"][REPLICA]["blocks_pinned"])


def _flood(sdk: anthropic.Anthropic, pause: int) -> None:
    """Other traffic: unrelated prompts, each its own blocks from the first."""
    for i in range(FLOODS):
        text = f"unrelated request {pause}.{i}: " + _words(1000 * pause + i, FLOOD_WORDS)
        sdk.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}])


def _control(sdk: anthropic.Anthropic) -> int:
    """An image conversation without tools or a session (nothing leases it): its reads."""
    ask: Any = [{"role": "user", "content": [_screenshot(0), {"type": "text", "text": "?"}]}]
    m = sdk.messages.create(
        model=MODEL, max_tokens=1, system="You look at pictures. " + _words(7, 300), messages=ask
    )
    return int(m.usage.cache_read_input_tokens or 0)


def test_an_image_agent_reads_each_turn_from_cache_under_pressure(
    url: str, closing: contextlib.ExitStack
) -> None:
    sdk = anthropic.Anthropic(base_url=url, api_key=ADMIN_KEY, max_retries=0, timeout=300)
    sdk = closing.enter_context(sdk)
    admin = closing.enter_context(httpx.Client(base_url=url, headers=ADMIN, timeout=60))
    engine = admin.get("/v1/cache/stats").json()["replicas"][REPLICA]["engine"]
    print(f"\nthe replica's cache: {engine}")
    system = "You are a computer-use agent. " + _words(1, 840)
    meta: Any = {"user_id": json.dumps({"session_id": "vision-agent"})}
    history: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [_screenshot(0), {"type": "text", "text": "Open the settings menu."}],
        }
    ]
    assert _control(sdk) == 0
    turns: list[Turn] = []
    for turn in range(TURNS):
        if turn:
            _flood(sdk, turn)
            if turn == 1:  # the flood evicts what nothing leases
                assert _control(sdk) == 0
        raw = sdk.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=64,
            system=system,
            tools=[TOOL],
            tool_choice=FORCED,
            messages=history,  # type: ignore[arg-type]
            metadata=meta,
        )
        m = raw.parse()
        assert m.stop_reason == "tool_use", (turn, m)
        u = m.usage
        turns.append(
            Turn(
                u.cache_read_input_tokens or 0,
                int(raw.headers["x-vcache-predicted-cached-tokens"]),
                _prompt(u),
                _pinned(admin),
            )
        )
        call = next(b for b in m.content if b.type == "tool_use")
        history.append({"role": "assistant", "content": [b.model_dump() for b in m.content]})
        result: list[dict[str, Any]] = [{"type": "text", "text": f"done: {_words(turn, 10)}"}]
        if (turn + 1) % SHOT_EVERY == 0 and turn + 1 < TURNS:  # the next turn's screenshot
            result.append(_screenshot((turn + 1) // SHOT_EVERY))
        history.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}],
            }
        )
    for i, t in enumerate(turns):
        print(
            f"turn {i:2d}: prompt {t.prompt}, read {t.read}, predicted {t.predicted}, "
            f"pinned {t.pinned}"
        )
    for i, t in enumerate(turns):
        assert t.predicted == t.read, (i, t)  # every prediction exact
        assert t.pinned == t.prompt // BLOCK, (i, t)  # the whole prompt leased, images too
        if i:
            assert t.read >= 0.95 * turns[i - 1].prompt, (i, t, turns[i - 1])
            assert t.read >= turns[i - 1].prompt // BLOCK * BLOCK, (i, t)
    assert turns[-1].prompt > 3000
    assert _control(sdk) == 0  # the last pause's flood evicted it again
