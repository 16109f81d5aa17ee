"""Rendering off the event loop (gateway/service/render_thread.py): jobs run on the
render thread with a tokenizer copy of its own, the loop serves other work while one
runs, and the gateway's chat templates all render there; other threads that render
(the session log's verification) have copies of their own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer, ThreadCopies
from gateway.app import create_app
from gateway.service.render_thread import THREAD_NAME, RenderThread
from tests.settings import gateway_settings

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "cache block token " * 40},
]


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


@pytest.fixture
def renders() -> Iterator[RenderThread]:
    r = RenderThread()
    yield r
    r.close()


def test_a_job_runs_on_the_render_thread_with_a_tokenizer_of_its_own(
    tokenizer: ChatTokenizer, renders: RenderThread
) -> None:
    def job(tok: ChatTokenizer) -> tuple[str, bool, list[int]]:
        return threading.current_thread().name, tok.hf is tokenizer.hf, tok.render_chat(MESSAGES)

    name, shared, ids = asyncio.run(renders.run(tokenizer, job))
    assert name.startswith(THREAD_NAME) and not shared
    assert ids == tokenizer.render_chat(MESSAGES)  # the copy renders as the original


def test_the_loop_serves_other_work_while_a_job_runs(
    tokenizer: ChatTokenizer, renders: RenderThread
) -> None:
    release = threading.Event()

    def slow(tok: ChatTokenizer) -> int:
        assert release.wait(10), "the loop never got to release the job"
        return len(tok.encode("cache block"))

    async def main() -> tuple[int, int]:
        job = asyncio.create_task(renders.run(tokenizer, slow))
        ticks = 0
        while ticks < 20:  # the job holds its thread: the loop goes on regardless
            await asyncio.sleep(0.001)
            ticks += 1
        assert not job.done()
        release.set()
        return ticks, await job

    ticks, n = asyncio.run(main())
    assert ticks == 20 and n == len(tokenizer.encode("cache block"))


def test_one_copy_per_tokenizer_made_again_for_a_new_one(
    tokenizer: ChatTokenizer, renders: RenderThread
) -> None:
    async def copies(tok: ChatTokenizer) -> list[object]:
        return [await renders.run(tok, lambda own: own.hf) for _ in range(3)]

    first = asyncio.run(copies(tokenizer))
    assert first[0] is first[1] is first[2] and first[0] is not tokenizer.hf
    other = tokenizer.clone()  # a restarted engine's tokenizer
    again = asyncio.run(copies(other))
    assert again[0] is not first[0] and again[0] is not other.hf


def test_each_thread_that_asks_has_a_copy_of_its_own(tokenizer: ChatTokenizer) -> None:
    copies = ThreadCopies()
    mine = copies(tokenizer)
    assert copies(tokenizer) is mine and mine.hf is not tokenizer.hf
    theirs: list[ChatTokenizer] = []
    t = threading.Thread(target=lambda: theirs.extend([copies(tokenizer), copies(tokenizer)]))
    t.start()
    t.join()
    assert theirs[0] is theirs[1] and theirs[0] is not mine
    assert copies(other := tokenizer.clone()) is not mine and copies(other) is copies(other)
    assert mine.render_chat(MESSAGES) == tokenizer.render_chat(MESSAGES)


def test_close_stops_the_thread(tokenizer: ChatTokenizer) -> None:
    r = RenderThread()
    asyncio.run(r.run(tokenizer, lambda tok: tok.encode("x")))
    assert any(t.name.startswith(THREAD_NAME) for t in threading.enumerate())
    r.close()
    assert not any(t.name.startswith(THREAD_NAME) for t in threading.enumerate())
    assert asyncio.run(r.run(tokenizer, lambda tok: tok.encode("x")))  # started again
    r.close()


def test_the_gateway_renders_every_chat_template_on_the_render_thread(
    tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    hf_class = type(tokenizer.hf)
    original = hf_class.apply_chat_template

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(hf_class, "apply_chat_template", recorded)
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=2048)
    log = {"path": str(tmp_path / "s.db"), "verify_reconstruction": False}  # (its rebuilds)
    app = create_app(gateway_settings(grpc_port=None, session_log=log), [engine])
    with TestClient(app) as http:
        seen.clear()  # the startup's own renders (the hash probe) are not requests
        chat = {"model": "vcache-demo", "max_tokens": 2, "messages": MESSAGES}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        count = {"model": "vcache-demo", "messages": MESSAGES[1:], "system": "You are terse."}
        r = http.post("/v1/messages/count_tokens", json=count)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        assert http.post("/tokenize", json={"messages": MESSAGES}).status_code == 200
    assert len(seen) >= 3 and all(name.startswith(THREAD_NAME) for name in seen), seen
