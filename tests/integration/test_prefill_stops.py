"""A batch prompt in prefill stops for an interactive one on a real vLLM CPU replica, and
starts again from the blocks it had computed.

One replica, which computes at most 8 tokens of a prompt a step
(``engine.long_prefill_token_threshold``; vLLM applies it only while another
request runs, so a long answer runs beside): a batch request's 1,460-token
prompt is in prefill for about 180 steps.  Once its first two blocks are
stored, an interactive request makes the gateway abort it in the engine
(``engine.preempt_prefills``); it waits for the interactive prompt's first
token, then runs again.  The full blocks its first attempt computed stayed in
vLLM's prefix cache, so the engine reports them as cached; its answer is whole.

With the gateway's guard off, the engine's own hold (``engine.top_prefill_alone``)
does it at the step boundary instead: the batch prompt skips the interactive
prompt's steps, nothing is aborted, and the core counts the steps it held.  The hold
is vLLM's ``scheduler_cls`` the gateway names (engines/vllm/top_first_scheduler.py): the
engine core's log says it built that class, and vLLM's own ``Scheduler.schedule`` is
left as it is.

On two replicas of this CPU host (``engine.guard_scope`` unset: ``host``), an
interactive prompt on one stops the batch prompt in prefill on the other.
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

from tests.integration.conftest import ADMIN, ADMIN_KEYS, metric, own_gateway, wait_for
from tests.integration.test_agent_sessions import VOCAB

pytestmark = pytest.mark.integration

BLOCK = 128
STOPS = 'vcache_prefill_stops_total{replica="replica-0"}'


def _gateway(tmp: Path, data_dir: Path, replicas: int, **extra: str) -> Iterator[str]:
    """A gateway of its own whose replicas compute at most 8 tokens of a prompt a step
    (its log, with its engine cores', in ``tmp``/gateway.log)."""
    args = ["--replicas", str(replicas), "--max-model-len", "2048"]
    settings = {"VCACHE_ENGINE__LONG_PREFILL_TOKEN_THRESHOLD": "8", **ADMIN_KEYS, **extra}
    with own_gateway(tmp, data_dir, args, settings) as base:
        yield base


@pytest.fixture(scope="module")
def url(
    data_dir: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    yield from _gateway(tmp_path_factory.mktemp("prefill-stops"), data_dir, 1)


@pytest.fixture(scope="module")
def unguarded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-hold")


@pytest.fixture(scope="module")
def unguarded(data_dir: Path, demo_model: Path, unguarded_dir: Path) -> Iterator[str]:
    off = {"VCACHE_ENGINE__FIRST_TOKEN_GUARD": "false"}
    yield from _gateway(unguarded_dir, data_dir, 1, **off)


@pytest.fixture(scope="module")
def two(
    data_dir: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    yield from _gateway(tmp_path_factory.mktemp("host-guard"), data_dir, 2)


def test_a_batch_prefill_gives_way_to_an_interactive_prompt(url: str) -> None:
    done = _interactive_beside_batch(url)
    assert metric(url, STOPS) == 1
    # its first attempt's full blocks were read back, nothing else could have been
    cached = done["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 2 * BLOCK and cached % BLOCK == 0, done["usage"]


def test_the_engine_holds_the_batch_prefill_itself(unguarded: str) -> None:
    steps = _engine_steps(unguarded)
    assert steps == {"uncapped": 0, "held": 0, "unfit": 0} or not steps  # nothing yet
    _interactive_beside_batch(unguarded)
    assert metric(unguarded, STOPS) == 0  # nothing aborted: the core held it
    got = _engine_steps(unguarded)
    # the interactive prompt's steps: the batch prompt held, the cap lifted
    assert got["held"] >= 1 and got["uncapped"] >= 1 and got["unfit"] == 0, got


def test_the_engine_core_runs_the_top_first_scheduler_class(
    unguarded: str, unguarded_dir: Path
) -> None:
    from engines.vllm.top_prefill import SCHEDULER_CLS

    log = (unguarded_dir / "gateway.log").read_text(errors="replace")
    # vLLM names the scheduler_cls it was given; the class says what it does
    assert f"Using custom scheduler class {SCHEDULER_CLS}" in log
    built = [line for line in log.splitlines() if "TopFirstScheduler: the top-priority" in line]
    assert built and all("whole (long-prefill cap lifted) True" in line for line in built), built
    assert all("alone (lower classes' prefills held) True" in line for line in built), built


def test_an_interactive_prompt_stops_a_batch_prefill_on_the_other_replica(two: str) -> None:
    _interactive_beside_batch(two, batch_on="replica-1", interactive_on="replica-0")
    assert metric(two, 'vcache_prefill_stops_total{replica="replica-1"}') == 1
    assert metric(two, STOPS) == 0  # nothing ran on replica-0 to stop


def _engine_steps(url: str) -> dict[str, int]:
    stats = httpx.get(f"{url}/v1/cache/stats", headers=ADMIN, timeout=30).json()
    steps: dict[str, int] = stats["replicas"]["replica-0"]["engine"]["top_prefill_steps"]
    return steps


def _interactive_beside_batch(
    url: str, batch_on: str = "replica-0", interactive_on: str = "replica-0"
) -> dict[str, Any]:
    """A long answer running, a batch prompt in prefill (two blocks of it stored), both
    on ``batch_on``, then an interactive prompt on ``interactive_on``; the batch
    request's answer, whole."""
    on_batch = {"x-vcache-replica": batch_on}
    running_there = f'vcache_engine_unfinished_requests{{replica="{batch_on}"}}'
    with httpx.Client(base_url=url, headers=ADMIN, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        words = " ".join(random.Random(time.time_ns()).choices(VOCAB, k=440))  # unique
        batch = {
            "model": model,
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Summarize: " + words}],
        }
        quick = {
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "Are the tests green?"}],
        }
        beside = {
            "model": model,
            "max_tokens": 600,
            "min_tokens": 600,
            "messages": [{"role": "user", "content": "Count."}],
        }
        assert metric(url, f'vcache_prefill_stops_total{{replica="{batch_on}"}}') == 0

        def stored() -> int:  # the batch prompt's tokens in the prefix cache, by the index
            r = c.post("/v1/cache/lookup", json={"model": model, "messages": batch["messages"]})
            by = {x["replica"]: x["predicted_cached_tokens"] for x in r.json()["replicas"]}
            return int(by[batch_on])

        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(c.post, "/v1/chat/completions", json=beside, headers=on_batch)
            wait_for(lambda: metric(url, running_there) >= 1, timeout_s=60, interval_s=0.02)
            bulk = pool.submit(
                c.post,
                "/v1/chat/completions",
                json=batch,
                headers={"x-vcache-priority": "batch", **on_batch},
            )
            wait_for(lambda: stored() >= 2 * BLOCK, timeout_s=60, interval_s=0.01)
            r = c.post(
                "/v1/chat/completions",
                json=quick,
                headers={"x-vcache-priority": "interactive", "x-vcache-replica": interactive_on},
            )
            assert r.status_code == 200, r.text
            done = bulk.result(timeout=120)
            assert running.result(timeout=120).status_code == 200
        assert done.status_code == 200, done.text
        body: dict[str, Any] = done.json()
        assert body["usage"]["completion_tokens"] == 8
        assert body["usage"]["prompt_tokens"] > 1024, body["usage"]  # 1,459 when written
        return body
