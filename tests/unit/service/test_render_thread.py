"""Rendering off the event loop (gateway/service/render_thread.py): jobs run on the
render thread with a tokenizer copy of its own, the loop serves other work while one
runs, and a job bounded under the inline characters runs on the loop only while the
thread is idle; the gateway renders a long chat prompt there and a short one on the
loop; other threads that render (the session log's verification) have copies of their
own."""

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
from gateway.service.breakpoints import PrefixLengths
from gateway.service.prompts import Prompts, chars
from gateway.service.render_thread import INLINE_CHARS, THREAD_NAME, RenderThread
from manifest.sessionlog import MessageEvent
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


LONG: list[dict[str, Any]] = [  # more than INLINE_CHARS of text the memo has not seen
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "cache block token " * (INLINE_CHARS // 16)},
]


def test_a_job_bounded_under_the_inline_characters_runs_on_the_loop(
    tokenizer: ChatTokenizer,
) -> None:
    renders = RenderThread(inline_chars=100)

    def where(tok: ChatTokenizer) -> tuple[str, bool]:
        return threading.current_thread().name, tok.hf is tokenizer.hf

    async def main() -> list[tuple[str, bool]]:
        return [
            await renders.run(tokenizer, where, lambda: 100),  # at the bound: the loop
            await renders.run(tokenizer, where, lambda: 101),  # one past it: the thread
            await renders.run(tokenizer, where),  # not bounded: the thread
            await renders.run(tokenizer, where, lambda: None),  # bounded by nothing
            await renders.run(tokenizer, where, lambda: 0),
        ]

    try:
        got = asyncio.run(main())
    finally:
        renders.close()
    loop = threading.current_thread().name  # asyncio.run's loop runs on this thread
    assert [name for name, _ in got] == [loop] + [got[1][0]] * 3 + [loop]
    assert got[1][0].startswith(THREAD_NAME) and loop != got[1][0]
    # the loop uses the thread's copy (idle), never the loop's own tokenizer
    assert not any(shared for _, shared in got)
    assert (renders.inline_runs, renders.thread_runs) == (2, 3)


def test_a_short_job_waits_its_turn_on_the_thread_while_it_is_busy(
    tokenizer: ChatTokenizer, renders: RenderThread
) -> None:
    release = threading.Event()
    order: list[str] = []

    def slow(tok: ChatTokenizer) -> str:
        assert release.wait(10), "the loop never got to release the job"
        order.append("slow")
        return threading.current_thread().name

    def short(tok: ChatTokenizer) -> str:
        order.append("short")
        return threading.current_thread().name

    async def main() -> tuple[str, str, bool]:
        long = asyncio.create_task(renders.run(tokenizer, slow))
        await asyncio.sleep(0.01)  # the slow job is on the thread
        busy = not renders.idle()
        quick = asyncio.create_task(renders.run(tokenizer, short, lambda: 1))
        await asyncio.sleep(0.01)
        assert not quick.done()  # behind the slow job: the copy has one user at a time
        release.set()
        return await long, await quick, busy

    slow_on, short_on, busy = asyncio.run(main())
    assert busy and order == ["slow", "short"]
    assert slow_on.startswith(THREAD_NAME) and short_on.startswith(THREAD_NAME)
    assert renders.idle()  # both done: the next short job may run on the loop again


def test_a_prompt_bounds_its_work_by_its_text_once_a_render_not_remembered(
    tokenizer: ChatTokenizer,
) -> None:
    system = ("You are terse.",)
    turns = (MessageEvent("user", "cache block token " * 10),)
    n = chars(system, turns, None)
    assert n == len(system[0]) + len(turns[0].content)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert chars(system, turns, tools) > n  # the tools' JSON counts
    # with the anchor asked, a render of its prefix too until it is remembered: twice
    # the text goes over a bound the prompt alone is under
    prompts = Prompts(inline_chars=n)
    thread = prompts._thread

    async def main() -> None:
        await prompts.rendered(tokenizer, system, turns, [], {}, anchor=True)
        assert (thread.inline_runs, thread.thread_runs) == (0, 1)  # 2n: the thread
        await prompts.rendered(tokenizer, system, turns, [], {}, anchor=True)
        assert (thread.inline_runs, thread.thread_runs) == (1, 1)  # n: the anchor known
        await prompts.chat(tokenizer, system, turns, None, {"chat_template": "{{ 1 }}"})
        assert (thread.inline_runs, thread.thread_runs) == (1, 2)  # its own template
        await prompts.chat(tokenizer, system, turns, None, {})
        assert (thread.inline_runs, thread.thread_runs) == (2, 2)

    try:
        asyncio.run(main())
    finally:
        prompts.close()
    assert PrefixLengths().renders(True, (), system, turns, []) == 1


def _renders_seen(
    tokenizer: ChatTokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    messages: Any,
    **engine: Any,
) -> list[str]:
    """The threads the gateway (its ``engine`` settings changed by ``engine``) rendered a
    chat, a token count and a tokenize on."""
    seen: list[str] = []
    hf_class = type(tokenizer.hf)
    original = hf_class.apply_chat_template

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(hf_class, "apply_chat_template", recorded)
    log = {"path": str(tmp_path / "s.db"), "verify_reconstruction": False}  # (its rebuilds)
    settings = gateway_settings(grpc_port=None, session_log=log, engine=engine)
    app = create_app(settings, [FakeEngine(tokenizer, block_size=16, max_model_len=2048)])
    with TestClient(app) as http:
        seen.clear()  # the startup's own renders (the hash probe) are not requests
        chat = {"model": "vcache-demo", "max_tokens": 2, "messages": messages}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        count = {"model": "vcache-demo", "messages": messages[1:], "system": "You are terse."}
        r = http.post("/v1/messages/count_tokens", json=count)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        assert http.post("/tokenize", json={"messages": messages}).status_code == 200
    return seen


def test_the_gateway_renders_a_long_chat_prompt_on_the_render_thread(
    tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sum(len(m["content"]) for m in LONG) > INLINE_CHARS
    seen = _renders_seen(tokenizer, tmp_path, monkeypatch, LONG)
    assert len(seen) >= 3 and all(name.startswith(THREAD_NAME) for name in seen), seen


def test_the_gateway_renders_a_short_chat_prompt_on_the_loop_where_set(
    tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sum(len(m["content"]) for m in MESSAGES) * 2 <= INLINE_CHARS  # with the anchor's
    seen = _renders_seen(
        tokenizer, tmp_path, monkeypatch, MESSAGES, render_inline_chars=INLINE_CHARS
    )
    assert len(seen) >= 3 and not any(name.startswith(THREAD_NAME) for name in seen), seen
    assert len(set(seen)) == 1  # the loop's thread (the test client's portal)


def test_by_default_the_gateway_renders_every_prompt_on_the_render_thread(
    tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine.render_inline_chars is 0 by default: inline renders cost the gateway 5-10%
    more CPU a request in three bench runs, for no TTFT difference a run resolved."""
    seen = _renders_seen(tokenizer, tmp_path, monkeypatch, MESSAGES)
    assert len(seen) >= 3 and all(name.startswith(THREAD_NAME) for name in seen), seen
