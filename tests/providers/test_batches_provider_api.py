"""The client of the providers' batch APIs (:class:`BatchAPIClient`) against the provider
emulator: a submission tried again after a 5xx and after an answer lost on the way (found
by what it made, never made twice), given up by name after its last try; a cancel passed
on to the provider's batch, its unfinished items read as canceled."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest

from engines.providers.base import Rendered
from engines.providers.specs import PROVIDERS
from engines.providers.transport import Response, Transport, TransportError
from gateway.batches.provider_client import BatchAPIClient, BatchAPIError, Endpoint, Unreadable
from tests.providers.conftest import MODELS, PROVIDER_KEY, Emulator

N = 3


def _endpoint(emulator: Emulator, provider: str) -> Endpoint:
    headers = PROVIDERS[provider].adapter().auth_headers(PROVIDER_KEY)
    return Endpoint(provider, emulator.base_url(provider), headers)


def _items(provider: str) -> list[tuple[str, Rendered]]:
    model = MODELS[provider]
    path = "/chat/completions" if provider == "openai" else "/messages"
    out = []
    for i in range(N):
        body = {
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"question {i}"}],
        }
        out.append((f"i{i}", Rendered(path, json.dumps(body).encode(), b"")))
    return out


def _batches(emulator: Emulator, provider: str, at_most: int = 100) -> list[dict[str, Any]]:
    """The batches the emulator holds for ``provider``, newest first (``at_most``)."""
    url = "/v1/batches" if provider == "openai" else "/v1/messages/batches"
    cursor = "after" if provider == "openai" else "after_id"
    headers = PROVIDERS[provider].adapter().auth_headers(PROVIDER_KEY)
    out: list[dict[str, Any]] = []
    after = ""
    while len(out) < at_most:
        r = emulator.http.get(f"{emulator.url}{url}?limit=100{after}", headers=headers)
        r.raise_for_status()
        page = r.json()
        out += page["data"]
        if not page["has_more"]:
            break
        after = f"&{cursor}={page['last_id']}"
    return out[:at_most]


def _others(emulator: Emulator, provider: str, n: int) -> None:
    """``n`` batches of one item each, made by another client of the same account."""
    headers = PROVIDERS[provider].adapter().auth_headers(PROVIDER_KEY)
    body = {
        "model": MODELS[provider],
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if provider == "openai":
        line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": body}
        f = emulator.http.post(
            f"{emulator.url}/v1/files",
            headers=headers,
            files={"file": ("other.jsonl", json.dumps(line).encode())},
            data={"purpose": "batch"},
        )
        f.raise_for_status()
        spec = {
            "input_file_id": f.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        url = f"{emulator.url}/v1/batches"
    else:
        spec = {"requests": [{"custom_id": "x", "params": body}]}
        url = f"{emulator.url}/v1/messages/batches"
    for _ in range(n):
        emulator.http.post(url, headers=headers, json=spec).raise_for_status()


class Counts:
    """The emulator's transport, counting the reads of a list of batches."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.lists = 0

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> AsyncIterator[Response]:
        if method == "GET" and url.split("?")[0].endswith("batches"):
            self.lists += 1
        async with self.inner.request(method, url, headers, body) as r:
            yield r

    async def aclose(self) -> None:
        return None


class LosesFirstCreate:
    """The emulator's transport, but the first batch create's answer is lost after the
    emulator made the batch (a timeout on the way back); ``then`` runs once it is lost
    (before the create is looked for)."""

    def __init__(self, inner: Transport, then: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.lost = 0
        self.then = then

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> AsyncIterator[Response]:
        async with self.inner.request(method, url, headers, body) as r:
            creates = method == "POST" and url.endswith(("/v1/batches", "/messages/batches"))
            if creates and not self.lost:
                await r.read()
                self.lost += 1
                if self.then is not None:
                    self.then()
                raise TransportError("the answer was lost", timeout=True)
            yield r

    async def aclose(self) -> None:
        return None


def _client(transport: Transport, **kw: Any) -> BatchAPIClient:
    return BatchAPIClient(transport, poll_s=0.01, backoff_s=0.01, **kw)


@pytest.fixture
def emu(emulator: Emulator) -> Emulator:
    emulator.admin("reset")
    emulator.admin("batch-rules", delay_s=0, parallel=4)
    return emulator


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_create_refused_with_a_5xx_is_tried_again_and_made_once(
    emu: Emulator, provider: str
) -> None:
    emu.admin("faults", kind="status", status=503, count=2, provider=provider)
    assert emu.transport is not None
    client = _client(emu.transport)

    async def main() -> str:
        return await client.submit(_endpoint(emu, provider), _items(provider), "tok-5xx")

    run_id = asyncio.run(main())
    assert [b["id"] for b in _batches(emu, provider)] == [run_id]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_create_whose_answer_was_lost_is_found_not_made_again(
    emu: Emulator, provider: str
) -> None:
    assert emu.transport is not None
    lossy = LosesFirstCreate(emu.transport)
    client = _client(lossy)

    async def main() -> str:
        return await client.submit(_endpoint(emu, provider), _items(provider), "tok-lost")

    run_id = asyncio.run(main())
    assert lossy.lost == 1
    assert [b["id"] for b in _batches(emu, provider)] == [run_id]  # made once
    creates = [r for r in emu.received() if r["path"] in ("/v1/batches", "/v1/messages/batches")]
    assert len(creates) == 1  # found by its token (OpenAI) or as the one new batch


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_lost_create_is_found_past_the_first_page_of_the_list(
    emu: Emulator, provider: str
) -> None:
    """Another client makes 150 batches between the lost create and the look for it: the
    one it made is on the second page of the provider's list (100 a page), found there
    (OpenAI: by its token; Anthropic: the one new batch of its size), never made again."""
    assert emu.transport is not None
    lossy = LosesFirstCreate(emu.transport, lambda: _others(emu, provider, 150))
    client = _client(lossy)
    e = _endpoint(emu, provider)

    async def main() -> str:
        return await client.submit(e, _items(provider), "tok-paged", await client.lookup(e))

    run_id = asyncio.run(main())
    assert lossy.lost == 1
    mine = [b for b in _batches(emu, provider, 200) if b["id"] == run_id]
    assert len(mine) == 1 and len(_batches(emu, provider, 200)) == 151
    creates = [r for r in emu.received() if r["path"] in ("/v1/batches", "/v1/messages/batches")]
    assert len(creates) == 1 + 150  # its own: once


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_kept_submission_is_looked_for_back_to_the_batches_before_it(
    emu: Emulator, provider: str
) -> None:
    """A submission kept before its create (a restart looks for it): with 150 batches of
    others made since, the one it made is found on the list's second page; one never
    made is told so once the list reaches the batches that were there before it (its
    lookup), without reading the rest of the list."""
    _others(emu, provider, 250)  # the account's older batches
    assert emu.transport is not None
    counts = Counts(emu.transport)
    client = _client(counts)
    e = _endpoint(emu, provider)

    async def main() -> tuple[Any, ...]:
        made_lookup = await client.lookup(e)
        run_id = await client.submit(e, _items(provider), "tok-kept", made_lookup)
        never_lookup = await client.lookup(e)
        _others(emu, provider, 150)
        lists = counts.lists
        found = await client.made(e, "tok-kept", made_lookup, N)
        never = await client.made(e, "tok-never", never_lookup, N)
        return run_id, found, never, counts.lists - lists

    run_id, found, never, reads = asyncio.run(main())
    assert found == run_id
    assert never is None
    assert reads == 2 + 2  # two pages each: the 150 since, then the horizon; not the 250


def test_two_new_message_batches_of_its_size_are_not_taken_for_never_made(emu: Emulator) -> None:
    """Anthropic's batches carry no token: two batches of the submission's size made since
    its lookup (another client's among them) cannot tell which is it, so the look says
    so rather than take it for never made (a restart would then submit it again)."""
    assert emu.transport is not None
    client = _client(emu.transport)
    e = _endpoint(emu, "anthropic")

    async def main() -> None:
        kept = await client.lookup(e)
        await client.submit(e, _items("anthropic"), "tok-a", kept)
        await client.submit(e, _items("anthropic"), "tok-b", kept)
        await client.made(e, "tok-a", kept, N)

    with pytest.raises(Unreadable, match="2 batches of its 3 requests"):
        asyncio.run(main())


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_look_past_its_bound_says_it_cannot_tell_and_makes_no_second_batch(
    emu: Emulator, provider: str
) -> None:
    """More batches made since the lost create than the look reads (here one page): the
    submission gives up naming why, rather than take it for never made and make a
    second batch."""
    assert emu.transport is not None
    lossy = LosesFirstCreate(emu.transport, lambda: _others(emu, provider, 150))
    client = _client(lossy, lookup_pages=1)
    e = _endpoint(emu, provider)

    async def main() -> str:
        return await client.submit(e, _items(provider), "tok-far", await client.lookup(e))

    with pytest.raises(Unreadable, match="could not tell whether"):
        asyncio.run(main())
    assert len(_batches(emu, provider, 200)) == 151  # its own made once, never twice


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_submission_failing_every_try_is_given_up_by_name(emu: Emulator, provider: str) -> None:
    emu.admin("faults", kind="status", status=500, count=3, provider=provider)
    assert emu.transport is not None
    client = _client(emu.transport, attempts=3)

    async def main() -> str:
        return await client.submit(_endpoint(emu, provider), _items(provider), "tok-down")

    with pytest.raises(BatchAPIError, match="failed after 3 tries"):
        asyncio.run(main())
    assert _batches(emu, provider) == []


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_cancel_is_passed_on_and_the_unfinished_items_read_as_canceled(
    emu: Emulator, provider: str
) -> None:
    emu.admin("batch-rules", delay_s=3600, parallel=4)  # it would not run for an hour
    assert emu.transport is not None
    client = _client(emu.transport)
    e = _endpoint(emu, provider)

    async def cancelled() -> bool:
        return True

    async def main() -> Any:
        run_id = await client.submit(e, _items(provider), "tok-cancel")
        return run_id, await client.wait(e, run_id, cancelled)

    run_id, done = asyncio.run(main())
    assert done.status in ("cancelled", "ended")
    assert [done.of(f"i{i}") for i in range(N)] == ["canceled"] * N
    [b] = _batches(emu, provider)
    assert b["id"] == run_id
    if provider == "openai":
        assert b["status"] == "cancelled"
    else:
        assert b["processing_status"] == "ended" and b["request_counts"]["canceled"] == N


def test_a_cancel_that_comes_after_the_end_reads_the_results(emu: Emulator) -> None:
    """The provider's batch ends between a poll and the cancel (OpenAI answers the cancel
    409): the cancel is given up and the results are read as they are, all answered."""
    emu.admin("batch-rules", delay_s=1, parallel=4)  # runs once the emulator's clock moves
    assert emu.transport is not None
    client = _client(emu.transport)
    e = _endpoint(emu, "openai")

    async def cancelled() -> bool:
        emu.admin("clock/advance", seconds=5)  # it runs (and ends) before the cancel
        return True

    async def main() -> Any:
        run_id = await client.submit(e, _items("openai"), "tok-late")
        return await client.wait(e, run_id, cancelled)

    done = asyncio.run(main())
    assert done.status == "completed"
    assert sorted(done.results) == [f"i{i}" for i in range(N)]
    assert all(done.results[f"i{i}"][0] == 200 for i in range(N))
