"""The client of the providers' batch APIs (:class:`BatchAPIClient`) against the provider
emulator: a submission tried again after a 5xx and after an answer lost on the way (found
by what it made, never made twice), given up by name after its last try; a cancel passed
on to the provider's batch, its unfinished items read as canceled."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from engines.providers.base import Rendered
from engines.providers.specs import PROVIDERS
from engines.providers.transport import Response, Transport, TransportError
from gateway.batches.provider_client import BatchAPIClient, BatchAPIError, Endpoint
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


def _batches(emulator: Emulator, provider: str) -> list[dict[str, Any]]:
    """The batches the emulator holds for ``provider``."""
    url = "/v1/batches" if provider == "openai" else "/v1/messages/batches"
    headers = PROVIDERS[provider].adapter().auth_headers(PROVIDER_KEY)
    r = emulator.http.get(f"{emulator.url}{url}?limit=100", headers=headers)
    r.raise_for_status()
    return list(r.json()["data"])


class LosesFirstCreate:
    """The emulator's transport, but the first batch create's answer is lost after the
    emulator made the batch (a timeout on the way back)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.lost = 0

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> AsyncIterator[Response]:
        async with self.inner.request(method, url, headers, body) as r:
            creates = method == "POST" and url.endswith(("/v1/batches", "/messages/batches"))
            if creates and not self.lost:
                await r.read()
                self.lost += 1
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
