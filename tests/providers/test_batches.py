"""The gateway's batch APIs on hosted targets, driven by the official SDKs, against the
provider emulator: OpenAI's ``files.create`` + ``batches.create`` + polling +
``files.content`` and Anthropic's ``messages.batches.create`` + ``results``, on each
provider the emulator serves.  Every item is answered, matched by ``custom_id``, and
every request the gateway sent for it rebuilds from the session log to the bytes sent."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types.messages import MessageBatchResult
from openai.types import Batch

from engines.providers.specs import PROVIDERS
from engines.providers.transport import Response, Transport
from engines.tokenizer import ChatTokenizer
from gateway.batches.store import BatchStore
from tests.providers.conftest import KEY, MANUAL, MODELS, PROVIDER_KEY, Emulator, Gw, make_gateway

ITEMS = 6


def _rebuilt(gw: Gw, target: str) -> int:
    """How many requests were sent to ``target``; each rebuilds from the log to the bytes
    that were sent."""
    log = gw.log()
    rows = [r for r in log.store.requests() if r.target == target]
    for row in rows:
        _, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256, row.request_id
    return len(rows)


def _until(done: Any, what: str, timeout_s: float = 30.0) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        out = done()
        if out:
            return out
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen in {timeout_s} s")


def _upload(client: openai.OpenAI, lines: Sequence[dict[str, Any]]) -> str:
    """A batch input file of ``lines`` (JSON lines), uploaded: its id."""
    data = b"".join(json.dumps(ln).encode() + b"\n" for ln in lines)
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def _completed(client: openai.OpenAI, batch_id: str) -> Batch:
    """The batch, polled as a client does until it has completed."""
    done: Batch = _until(
        lambda: (b := client.batches.retrieve(batch_id)).status == "completed" and b,
        "the batch's end",
    )
    return done


def _output(client: openai.OpenAI, done: Batch) -> list[dict[str, Any]]:
    """The lines of a completed batch's output file."""
    assert done.output_file_id is not None
    return [json.loads(x) for x in client.files.content(done.output_file_id).read().splitlines()]


def _message_results(client: anthropic.Anthropic, requests: Any) -> dict[str, MessageBatchResult]:
    """A Message Batch of ``requests`` created and polled until it ended: each result by
    its custom_id."""
    batch = client.messages.batches.create(requests=requests)
    _until(
        lambda: client.messages.batches.retrieve(batch.id).processing_status == "ended",
        "the batch's end",
    )
    return {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}


@pytest.mark.parametrize("provider", ["openai", "anthropic", "deepseek", "gemini"])
def test_the_openai_batch_api_on_a_hosted_target(gw: Gw, provider: str) -> None:
    target = f"{provider}/{MODELS[provider]}"
    client = gw.client()
    lines = [
        {
            "custom_id": f"item-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": target,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": MANUAL},
                    {"role": "user", "content": f"what is section {i} about?"},
                ],
            },
        }
        for i in range(ITEMS)
    ]
    file_id = _upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _completed(client, batch.id)
    assert done.request_counts is not None and done.request_counts.completed == ITEMS
    assert done.output_file_id is not None and done.error_file_id is None
    out = _output(client, done)
    assert sorted(x["custom_id"] for x in out) == [f"item-{i}" for i in range(ITEMS)]
    for x in out:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and body["choices"][0]["message"]["content"]
    assert _rebuilt(gw, target) == ITEMS


def test_the_anthropic_message_batches_api_on_a_hosted_target(gw: Gw) -> None:
    target = f"anthropic/{MODELS['anthropic']}"
    client = anthropic.Anthropic(
        base_url="http://testserver", api_key=KEY, http_client=gw.http, max_retries=0
    )
    system: Any = [{"type": "text", "text": MANUAL, "cache_control": {"type": "ephemeral"}}]
    requests: Any = [
        {
            "custom_id": f"m-{i}",
            "params": {
                "model": target,
                "max_tokens": 4,
                "system": system,
                "messages": [{"role": "user", "content": f"what is section {i} about?"}],
            },
        }
        for i in range(ITEMS)
    ]
    results = _message_results(client, requests)
    assert sorted(results) == [f"m-{i}" for i in range(ITEMS)]
    assert all(r.type == "succeeded" for r in results.values())
    reads = [r.message.usage.cache_read_input_tokens or 0 for r in results.values()]  # type: ignore[union-attr]
    assert sum(1 for n in reads if n > 0) >= ITEMS - 1  # the lead wrote, its siblings read
    assert _rebuilt(gw, target) == ITEMS


def test_an_openai_batch_on_an_unknown_hosted_model_fails_each_item(gw: Gw) -> None:
    client: openai.OpenAI = gw.client()
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "nowhere/none", "messages": [{"role": "user", "content": "hi"}]},
    }
    file_id = _upload(client, [line])
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _completed(client, batch.id)
    assert done.request_counts is not None and done.request_counts.failed == 1
    assert done.error_file_id is not None
    [err] = [json.loads(x) for x in client.files.content(done.error_file_id).read().splitlines()]
    assert err["custom_id"] == "x" and err["response"]["status_code"] == 404


@pytest.fixture
def via_api(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    """A gateway that sends a batch to its provider's batch API where the plan chooses it."""
    emulator.admin("reset")
    emulator.admin("batch-rules", delay_s=0, parallel=4)
    batches = {"provider_api": True, "provider_poll_s": 0.05, "poll_s": 0.05}
    yield from make_gateway(emulator, tokenizer, batches=batches)


def _openai_batch(gw: Gw, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    client = gw.client()
    file_id = _upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _completed(client, batch.id)
    assert done.request_counts is not None and done.request_counts.completed == len(lines)
    assert done.output_file_id is not None
    return _output(client, done)


def _lines(target: str, system: Callable[[int], str]) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"item-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": target,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": system(i)},
                    {"role": "user", "content": f"what is section {i} about?"},
                ],
            },
        }
        for i in range(ITEMS)
    ]


def test_a_batch_the_plan_sends_to_openais_batch_api(via_api: Gw) -> None:
    """On OpenAI (reads at 0.5) half price wins: one submission to the batch API, every
    item answered from it by custom_id, each journaled item rebuilt to the bytes in the
    provider's batch file."""
    target = f"openai/{MODELS['openai']}"
    out = _openai_batch(via_api, _lines(target, lambda i: MANUAL))
    assert sorted(x["custom_id"] for x in out) == [f"item-{i}" for i in range(ITEMS)]
    assert all(x["response"]["body"]["object"] == "chat.completion" for x in out)
    bill = via_api.emulator.admin_get("billing")
    assert bill["openai-batch"]["requests"] == ITEMS and "openai" not in bill
    assert _rebuilt(via_api, target) == ITEMS
    sent = [r for r in via_api.emulator.received() if r["path"] == "/v1/batches"]
    assert len(sent) == 1


def test_the_plan_keeps_a_shared_anthropic_batch_online_and_sends_a_flat_one(
    via_api: Gw,
) -> None:
    """Anthropic reads at 0.1: six items under one long prefix are cheaper online in DAG
    order; six items with nothing shared go to the Message Batches API."""
    target = f"anthropic/{MODELS['anthropic']}"
    _openai_batch(via_api, _lines(target, lambda i: MANUAL))
    bill = via_api.emulator.admin_get("billing")
    assert bill["anthropic"]["requests"] == ITEMS and "anthropic-batch" not in bill
    out = _openai_batch(via_api, _lines(target, lambda i: f"Manual {i}. " + MANUAL))
    assert all(x["response"]["status_code"] == 200 for x in out)
    bill = via_api.emulator.admin_get("billing")
    assert bill["anthropic-batch"]["requests"] == ITEMS
    assert _rebuilt(via_api, target) == 2 * ITEMS


def test_a_restart_resumes_the_providers_batch_without_submitting_again(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """A gateway that stops while OpenAI's batch API runs its batch: the next one over the
    same data (its leases run out) polls that provider batch rather than submit the items
    again; every item is answered once, billed once, and rebuilds from the log."""
    log = {"path": str(tmp_path / "sessions.db"), "verify_reconstruction": True}
    restart_resumes(emulator, tokenizer, log, lambda: BatchStore(tmp_path / "batches.db"))


def restart_resumes(
    emulator: Emulator,
    tokenizer: ChatTokenizer,
    log: dict[str, Any],
    open_store: Callable[[], BatchStore],
) -> None:
    """The restart test over a session log ``log`` whose batch store ``open_store``
    opens (SQLite beside it here; PostgreSQL in the stores tier)."""
    emulator.admin("reset")
    emulator.admin("batch-rules", delay_s=3600, parallel=4)  # not run before the restart
    target = f"openai/{MODELS['openai']}"
    batches = {"provider_api": True, "provider_poll_s": 0.05, "poll_s": 0.05, "lease_s": 0.5}
    gateway = contextlib.contextmanager(make_gateway)
    first = contextlib.ExitStack()
    gw = first.enter_context(gateway(emulator, tokenizer, batches=batches, session_log=log))
    client = gw.client()
    file_id = _upload(client, _lines(target, lambda i: MANUAL))
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    seen = open_store()  # the gateway's batch store
    try:
        _until(
            lambda: any(not r.submitting for r in seen.provider_runs(batch.id)),
            "the submission kept with its id",
        )
    finally:
        seen.close()
    first.close()  # the gateway stops; the provider's batch runs on
    emulator.admin("batch-rules", delay_s=0, parallel=4)
    with gateway(emulator, tokenizer, batches=batches, session_log=log) as gw:
        client = gw.client()
        done = _completed(client, batch.id)
        assert done.request_counts is not None and done.request_counts.completed == ITEMS
        assert done.output_file_id is not None
        out = _output(client, done)
        assert sorted(x["custom_id"] for x in out) == [f"item-{i}" for i in range(ITEMS)]
        sent = [r for r in emulator.received() if r["path"] == "/v1/batches"]
        assert len(sent) == 1  # submitted once, over both gateways
        assert emulator.admin_get("billing")["openai-batch"]["requests"] == ITEMS
        assert _rebuilt(gw, target) == ITEMS
        answered = {r.request_id for r in gw.log().store.requests() if r.target == target}
        assert {x["response"]["body"]["id"] for x in out} == answered


class DiesAfterCreate:
    """The emulator's transport, but the gateway dies once the provider has answered a
    batch create: the answer never reaches it (the call waits until the gateway stops),
    so nothing after the create is written."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.created = threading.Event()

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> AsyncIterator[Response]:
        async with self.inner.request(method, url, headers, body) as r:
            if method == "POST" and url.endswith(("/v1/batches", "/messages/batches")):
                await r.read()
                self.created.set()
                await asyncio.Event().wait()  # cancelled as the gateway stops
            yield r

    async def aclose(self) -> None:
        return None


def _provider_batches(emulator: Emulator, provider: str) -> list[dict[str, Any]]:
    """The batches the emulator holds for ``provider``."""
    url = "/v1/batches" if provider == "openai" else "/v1/messages/batches"
    headers = PROVIDERS[provider].adapter().auth_headers(PROVIDER_KEY)
    r = emulator.http.get(f"{emulator.url}{url}?limit=100", headers=headers)
    r.raise_for_status()
    return list(r.json()["data"])


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_gateway_killed_between_the_create_and_the_store_write_makes_one_batch(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path, provider: str
) -> None:
    """The gateway dies after the provider made the batch but before its id is written:
    the next gateway finds that batch (OpenAI: by the token in its metadata; Anthropic:
    the one new batch of its size) and polls it.  Exactly one provider batch, every item
    answered once, billed once, rebuilt from the log."""
    log = {"path": str(tmp_path / "sessions.db"), "verify_reconstruction": True}
    killed_after_create(
        emulator, tokenizer, log, lambda: BatchStore(tmp_path / "batches.db"), provider
    )


def killed_after_create(
    emulator: Emulator,
    tokenizer: ChatTokenizer,
    log: dict[str, Any],
    open_store: Callable[[], BatchStore],
    provider: str,
) -> None:
    """The kill test over a session log ``log`` whose batch store ``open_store`` opens."""
    emulator.admin("reset")
    emulator.admin("batch-rules", delay_s=0, parallel=4)
    target = f"{provider}/{MODELS[provider]}"
    batches = {"provider_api": True, "provider_poll_s": 0.05, "poll_s": 0.05, "lease_s": 0.5}
    gateway = contextlib.contextmanager(make_gateway)
    dies = DiesAfterCreate(emulator.transport)  # type: ignore[arg-type]
    first = contextlib.ExitStack()
    gw = first.enter_context(
        gateway(
            dataclasses.replace(emulator, transport=dies),
            tokenizer,
            batches=batches,
            session_log=log,
        )
    )
    client = gw.client()
    lines = _lines(target, lambda i: f"Manual {i}. " + MANUAL)  # the batch API's, on both
    file_id = _upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert dies.created.wait(30), "the provider never got the create"
    first.close()  # killed: the create answered, its id never written
    seen = open_store()
    try:
        [run] = seen.provider_runs(batch.id)
        assert run.submitting and sorted(run.items) == list(range(ITEMS))
    finally:
        seen.close()
    assert len(_provider_batches(emulator, provider)) == 1
    with gateway(emulator, tokenizer, batches=batches, session_log=log) as gw:
        client = gw.client()
        done = _completed(client, batch.id)
        assert done.request_counts is not None and done.request_counts.completed == ITEMS
        assert done.output_file_id is not None
        out = _output(client, done)
        assert sorted(x["custom_id"] for x in out) == [f"item-{i}" for i in range(ITEMS)]
        assert all(x["response"]["status_code"] == 200 for x in out)
        assert len(_provider_batches(emulator, provider)) == 1  # found, not made again
        assert emulator.admin_get("billing")[f"{provider}-batch"]["requests"] == ITEMS
        assert _rebuilt(gw, target) == ITEMS


def _stopped_with_a_kept_submission(
    emulator: Emulator,
    tokenizer: ChatTokenizer,
    log: dict[str, Any],
    model: str,
    kept: str,
    **cfg: Any,
) -> str:
    """A gateway (configured with ``cfg``) that stops while a batch of ``model`` is on
    OpenAI's batch API, its submission kept ``running`` (its id written) or
    ``submitting`` (it died once the create was made, before the id was written): the
    vcache batch's id."""
    emulator.admin("reset")
    emulator.admin("batch-rules", delay_s=3600, parallel=4)  # not run before the restart
    dies = DiesAfterCreate(emulator.transport)  # type: ignore[arg-type]
    seen = emulator if kept == "running" else dataclasses.replace(emulator, transport=dies)
    with contextlib.contextmanager(make_gateway)(seen, tokenizer, session_log=log, **cfg) as gw:
        client = gw.client()
        file_id = _upload(client, _lines(model, lambda i: f"Manual {i}. " + MANUAL))
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        store: BatchStore = gw.http.app.state.batches  # type: ignore[attr-defined]
        if kept == "running":
            _until(
                lambda: any(not r.submitting for r in store.provider_runs(batch.id)),
                "the submission kept with its id",
            )
        else:
            assert dies.created.wait(30), "the provider never got the create"
    assert len(_provider_batches(emulator, "openai")) == 1
    return batch.id


@pytest.mark.parametrize(
    ("removed", "kept"), [("openai", "running"), ("openai", "submitting"), ("all", "running")]
)
def test_a_resumed_submission_whose_provider_was_removed_ends_each_item_by_name(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path, removed: str, kept: str
) -> None:
    """The gateway restarts without the provider the batch's submission went to (its
    configuration dropped OpenAI, or every provider): the submission cannot be followed,
    so each item it
    carries ends with a 502 ``provider_batch_unreadable`` naming the provider's batch
    (or the token it was made under), the vcache batch ends, nothing is submitted or sent
    online again, and the submission is marked ended rather than looked for forever."""
    log = {"path": str(tmp_path / "sessions.db"), "verify_reconstruction": True}
    target = f"openai/{MODELS['openai']}"
    batches = {"provider_api": True, "provider_poll_s": 0.05, "poll_s": 0.05, "lease_s": 0.5}
    bid = _stopped_with_a_kept_submission(emulator, tokenizer, log, target, kept, batches=batches)
    emulator.admin("batch-rules", delay_s=0, parallel=4)
    others = {
        p: {"base_url": emulator.base_url(p), "api_key": PROVIDER_KEY}
        for p in MODELS
        if p != "openai" and removed != "all"
    }
    aliases: dict[str, list[str]] = {}  # none naming a provider no longer there
    with contextlib.contextmanager(make_gateway)(
        emulator, tokenizer, batches=batches, session_log=log, providers=others, aliases=aliases
    ) as gw:
        client = gw.client()
        done = _until(
            lambda: (b := client.batches.retrieve(bid)).status == "completed" and b,
            "the batch's end",
            timeout_s=20,
        )
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (0, ITEMS)
        assert done.output_file_id is None and done.error_file_id is not None
        errors = [
            json.loads(x) for x in client.files.content(done.error_file_id).read().splitlines()
        ]
        assert sorted(x["custom_id"] for x in errors) == [f"item-{i}" for i in range(ITEMS)]
        for x in errors:
            assert x["response"]["status_code"] == 502
            err = x["response"]["body"]["error"]
            assert err["code"] == "provider_batch_unreadable"
            assert target in err["message"]
        store: BatchStore = gw.http.app.state.batches  # type: ignore[attr-defined]
        assert store.provider_runs(bid) == []  # ended, not looked for again
    assert len(_provider_batches(emulator, "openai")) == 1  # never submitted again
    assert "openai" not in emulator.admin_get("billing")  # nor sent online


def test_a_resumed_submission_is_read_with_the_provider_api_turned_off(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """The gateway restarts with ``batches.provider_api`` off: new batches go online, but
    the submission kept before the restart is still polled and its items answered from
    it, never sent online a second time (billed twice)."""
    log = {"path": str(tmp_path / "sessions.db"), "verify_reconstruction": True}
    target = f"openai/{MODELS['openai']}"
    batches = {"provider_api": True, "provider_poll_s": 0.05, "poll_s": 0.05, "lease_s": 0.5}
    bid = _stopped_with_a_kept_submission(
        emulator, tokenizer, log, target, "running", batches=batches
    )
    emulator.admin("batch-rules", delay_s=0, parallel=4)
    off = {**batches, "provider_api": False}
    with contextlib.contextmanager(make_gateway)(
        emulator, tokenizer, batches=off, session_log=log
    ) as gw:
        client = gw.client()
        done = _completed(client, bid)
        assert done.request_counts is not None and done.request_counts.completed == ITEMS
        assert all(x["response"]["status_code"] == 200 for x in _output(client, done))
        bill = emulator.admin_get("billing")
        assert bill["openai-batch"]["requests"] == ITEMS and "openai" not in bill
        assert _rebuilt(gw, target) == ITEMS


def test_a_resumed_submission_whose_target_left_its_alias_is_still_read(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """The gateway restarts with the batch's alias pointing elsewhere (its target removed
    from it; the provider still configured): the submission made to that target is
    still polled and every item answered from it, billed once, rebuilt from the log;
    nothing is refused as no longer routed there (the answers would be lost)."""
    log = {"path": str(tmp_path / "sessions.db"), "verify_reconstruction": True}
    target = f"openai/{MODELS['openai']}"
    batches = {"provider_api": True, "provider_poll_s": 0.05, "poll_s": 0.05, "lease_s": 0.5}
    bid = _stopped_with_a_kept_submission(
        emulator, tokenizer, log, "bulk", "running", batches=batches, aliases={"bulk": [target]}
    )
    emulator.admin("batch-rules", delay_s=0, parallel=4)
    moved = {"bulk": [f"anthropic/{MODELS['anthropic']}"]}
    with contextlib.contextmanager(make_gateway)(
        emulator, tokenizer, batches=batches, session_log=log, aliases=moved
    ) as gw:
        client = gw.client()
        done = _completed(client, bid)
        assert done.request_counts is not None and done.request_counts.completed == ITEMS
        out = _output(client, done)
        assert all(x["response"]["status_code"] == 200 for x in out)
        assert emulator.admin_get("billing")["openai-batch"]["requests"] == ITEMS
        assert _rebuilt(gw, target) == ITEMS
    assert len(_provider_batches(emulator, "openai")) == 1


def test_the_plans_1h_ttl_is_on_the_submitted_items_breakpoints(via_api: Gw) -> None:
    """A flat Anthropic batch goes to the Message Batches API with the breakpoint TTL the
    plan picks there (1 hour at the prior hit share): each item's breakpoint carries
    ``ttl: "1h"``, the provider bills the writes at the long tier, and each journaled
    request rebuilds to those bytes."""
    target = f"anthropic/{MODELS['anthropic']}"
    out = _openai_batch(via_api, _lines(target, lambda i: f"Manual {i}. " + MANUAL))
    assert all(x["response"]["status_code"] == 200 for x in out)
    sent = via_api.emulator.last_body()  # the create: nothing is logged after it
    marks = [
        block["cache_control"]
        for r in sent["requests"]
        for block in r["params"]["system"]
        if "cache_control" in block
    ]
    assert len(sent["requests"]) == ITEMS and len(marks) == ITEMS
    assert all(m == {"type": "ephemeral", "ttl": "1h"} for m in marks)
    bill = via_api.emulator.admin_get("billing")["anthropic-batch"]
    assert bill["write_long"] > 0 and bill["write"] == 0
    assert _rebuilt(via_api, target) == ITEMS


def test_a_finished_provider_batch_calibrates_the_plans_hit_share(via_api: Gw) -> None:
    """OpenAI's batch API answers six items under one manual in waves of four (leads
    first): the first wave reads nothing, the second's two siblings read the manual.
    The five siblings' measure is kept in the batch store and moves the plan's hit share
    off its prior."""
    target = f"openai/{MODELS['openai']}"
    _openai_batch(via_api, _lines(target, lambda i: MANUAL))
    store: BatchStore = via_api.http.app.state.batches  # type: ignore[attr-defined]
    hits, reads = store.hit_shares()[(target, "implicit")]
    assert reads == ITEMS - 1 and 1.5 < hits <= 2.0
    targets = via_api.http.app.state.batch_targets  # type: ignore[attr-defined]
    [option] = targets.options(target)
    assert option.hit_share["implicit"] == pytest.approx((0.64 * 20 + hits) / (20 + reads))


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
def test_a_message_batch_the_plan_sends_to_a_providers_batch_api(
    via_api: Gw, provider: str
) -> None:
    """Messages items (the Message Batches API, through the anthropic SDK) with nothing
    shared go to the target's own batch API, each served as the chat request it maps to
    and rendered for its provider (Anthropic's Message Batches, OpenAI's Batch API of
    chat completions): one submission, every result a Message matched by custom_id,
    each journaled request rebuilt to the bytes in the provider's batch."""
    target = f"{provider}/{MODELS[provider]}"
    client = anthropic.Anthropic(
        base_url="http://testserver", api_key=KEY, http_client=via_api.http, max_retries=0
    )
    requests: Any = [
        {
            "custom_id": f"m-{i}",
            "params": {
                "model": target,
                "max_tokens": 4,
                "system": f"Manual {i}. " + MANUAL,
                "messages": [{"role": "user", "content": f"what is section {i} about?"}],
            },
        }
        for i in range(ITEMS)
    ]
    results = _message_results(client, requests)
    assert sorted(results) == [f"m-{i}" for i in range(ITEMS)]
    for r in results.values():
        assert r.type == "succeeded"
        assert r.message.type == "message" and r.message.model == target
        u = r.message.usage
        prompt = u.input_tokens + (u.cache_creation_input_tokens or 0)
        assert prompt + (u.cache_read_input_tokens or 0) > 1000  # the manual, as billed
    bill = via_api.emulator.admin_get("billing")
    assert bill[f"{provider}-batch"]["requests"] == ITEMS and provider not in bill
    creates = ("/v1/batches", "/v1/messages/batches")
    assert len([r for r in via_api.emulator.received() if r["path"] in creates]) == 1
    assert _rebuilt(via_api, target) == ITEMS


def _responses_batch(client: openai.OpenAI, target: str, extra: Mapping[str, Any]) -> Batch:
    """A batch on ``/v1/responses`` of ``ITEMS`` questions, each under a manual of its own
    (nothing shared), with ``extra`` in each body; the batch once completed."""
    lines = [
        {
            "custom_id": f"r-{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": target,
                "instructions": f"Manual {i}. " + MANUAL,
                "input": f"what is section {i} about?",
                **extra,
            },
        }
        for i in range(ITEMS)
    ]
    file_id = _upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/responses", completion_window="24h"
    )
    return _completed(client, batch.id)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_responses_batch_the_plan_sends_to_a_providers_batch_api(
    via_api: Gw, provider: str
) -> None:
    """Responses items (an OpenAI batch on ``/v1/responses``, through the openai SDK) with
    nothing shared go to the target's own batch API, each served as the chat request it
    maps to: one submission, every result a Response matched by
    custom_id, each journaled request rebuilt to the bytes in the provider's batch."""
    target = f"{provider}/{MODELS[provider]}"
    client = via_api.client()
    done = _responses_batch(client, target, {"max_output_tokens": 16})
    assert done.request_counts is not None and done.request_counts.completed == ITEMS
    assert done.output_file_id is not None
    out = _output(client, done)
    assert sorted(x["custom_id"] for x in out) == [f"r-{i}" for i in range(ITEMS)]
    for x in out:
        assert x["response"]["status_code"] == 200
        r = x["response"]["body"]
        assert (r["object"], r["status"], r["model"]) == ("response", "completed", target)
        [msg] = r["output"]
        assert msg["type"] == "message" and msg["content"][0]["type"] == "output_text"
        assert msg["content"][0]["text"]
        assert r["usage"]["input_tokens"] > 1000  # the manual, as billed
    bill = via_api.emulator.admin_get("billing")
    assert bill[f"{provider}-batch"]["requests"] == ITEMS and provider not in bill
    assert len(_provider_batches(via_api.emulator, provider)) == 1
    assert _rebuilt(via_api, target) == ITEMS


LOOKUP: Any = {
    "type": "function",
    "name": "lookup_section",
    "description": "The text of a section of the manual",
    "parameters": {
        "type": "object",
        "properties": {"section": {"type": "string"}},
        "required": ["section"],
    },
}


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_responses_item_a_providers_batch_answered_is_stored_and_goes_on(
    via_api: Gw, provider: str
) -> None:
    """A Responses item answered through the provider's batch API is stored like an
    online one: ``GET /v1/responses/{id}`` finds each result's Response, and a
    conversation goes on from it by ``previous_response_id``: the tool call it made,
    journaled with its answer, is what the next turn's ``function_call_output``
    answers (Anthropic refuses a ``tool_result`` that answers no ``tool_use``)."""
    target = f"{provider}/{MODELS[provider]}"
    client = via_api.client()
    extra = {"max_output_tokens": 64, "tools": [LOOKUP], "tool_choice": "required"}
    done = _responses_batch(client, target, extra)
    assert done.request_counts is not None and done.request_counts.completed == ITEMS
    assert len(_provider_batches(via_api.emulator, provider)) == 1  # its batch API's
    out = {x["custom_id"]: x["response"]["body"] for x in _output(client, done)}
    auth = {"authorization": f"Bearer {KEY}"}
    for body in out.values():
        r = via_api.http.get(f"/v1/responses/{body['id']}", headers=auth)
        assert r.status_code == 200, r.text
        stored = r.json()
        for key in ("id", "status", "model", "output", "usage", "tools", "tool_choice"):
            assert stored[key] == body[key], key
    first = out["r-0"]
    [call] = [o for o in first["output"] if o["type"] == "function_call"]
    assert call["name"] == "lookup_section"
    nxt = client.responses.create(
        model=target,
        previous_response_id=first["id"],
        input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "caching"}],
        tools=[LOOKUP],
        max_output_tokens=16,
    )
    assert nxt.status == "completed" and nxt.previous_response_id == first["id"]
    sent = json.dumps(via_api.emulator.last_body())
    assert "what is section 0 about?" in sent and "caching" in sent  # its history, from the log
    assert sent.count(call["call_id"]) == 2  # the call, and the output answering it


def test_a_responses_batch_chained_by_previous_response_id_stays_online(via_api: Gw) -> None:
    """An item naming a ``previous_response_id`` reads its history from the session log:
    the batch it is in goes online (no provider batch), every item answered, the chained
    one sent with its history."""
    target = f"openai/{MODELS['openai']}"
    client = via_api.client()
    first = client.responses.create(
        model=target, instructions=MANUAL, input="what is section 1 about?", max_output_tokens=16
    )
    lines = [
        {
            "custom_id": f"r-{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": target,
                "max_output_tokens": 16,
                "input": f"and section {i}?",
                **({"previous_response_id": first.id} if i == 0 else {"instructions": MANUAL}),
            },
        }
        for i in range(2)
    ]
    file_id = _upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/responses", completion_window="24h"
    )
    done = _completed(client, batch.id)
    assert done.request_counts is not None and done.request_counts.completed == 2
    assert done.output_file_id is not None
    out = {
        x["custom_id"]: x["response"]["body"]
        for x in map(json.loads, client.files.content(done.output_file_id).read().splitlines())
    }
    assert {r["object"] for r in out.values()} == {"response"}
    log = via_api.log()
    sent = [log.rebuild(r.session_id, r.seq)[1] for r in log.store.requests()]
    [chained] = [x for x in sent if b"and section 0?" in x]
    assert b"what is section 1 about?" in chained  # its history, from the log
    bill = via_api.emulator.admin_get("billing")
    assert "openai-batch" not in bill and bill["openai"]["requests"] == 3
    assert _provider_batches(via_api.emulator, "openai") == []


def test_a_cancel_reaches_the_providers_batch(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """A batch running on OpenAI's batch API, cancelled through the SDK: the cancel is
    passed on to the provider's batch, and the vcache batch ends cancelled with every
    item the provider had not run in the error file as batch_cancelled."""
    emulator.admin("reset")
    emulator.admin("batch-rules", delay_s=3600, parallel=4)  # it would not run for an hour
    target = f"openai/{MODELS['openai']}"
    log = {"path": str(tmp_path / "sessions.db"), "verify_reconstruction": True}
    batches = {"provider_api": True, "provider_poll_s": 0.05, "poll_s": 0.05}
    gateway = contextlib.contextmanager(make_gateway)
    with gateway(emulator, tokenizer, batches=batches, session_log=log) as gw:
        client = gw.client()
        lines = _lines(target, lambda i: MANUAL)
        file_id = _upload(client, lines)
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        store: BatchStore = gw.http.app.state.batches  # type: ignore[attr-defined]
        # made at the provider: its id there, not the token it is kept under while
        # ``submitting`` (read too early, the provider had no batch of that id to show)
        [run] = _until(
            lambda: [r for r in store.provider_runs(batch.id) if not r.submitting],
            "the provider's batch made",
        )
        client.batches.cancel(batch.id)
        done = _until(
            lambda: (b := client.batches.retrieve(batch.id)).status == "cancelled" and b,
            "the batch's end",
        )
        assert done.output_file_id is None and done.error_file_id is not None
        errors = [
            json.loads(x) for x in client.files.content(done.error_file_id).read().splitlines()
        ]
        assert sorted(x["custom_id"] for x in errors) == [f"item-{i}" for i in range(ITEMS)]
        assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
        headers = {"authorization": f"Bearer {PROVIDER_KEY}"}
        there = emulator.http.get(f"{emulator.url}/v1/batches/{run.id}", headers=headers)
        assert there.json()["status"] == "cancelled"  # the provider's batch was cancelled
        assert store.provider_runs(batch.id) == []
