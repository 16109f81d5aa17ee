"""The one service loop over in-memory targets: the order of its stages, fallback
before the first token, a retry prepared again and journaled as its own dispatch,
and the answer journaled before its usage goes out."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.core.errors import BadGateway, InvalidRequest, Unavailable
from gateway.core.metrics import Metrics
from gateway.core.outputs import Usage
from gateway.core.schemas import ChatCompletionRequest, ChatMessage
from gateway.core.shaping import Piece, Pieces
from gateway.core.target import Call, Sent
from gateway.core.types import Principal, Served
from gateway.service.journal import Journal
from gateway.service.loop import ServiceLoop
from manifest.sessionlog import Header, MessageEvent


@dataclass(frozen=True)
class FakePrepared:
    target: str
    request_id: str
    header: Header = field(default_factory=lambda: Header.make("m", "t", (), None, {}))
    turns: tuple[MessageEvent, ...] = (MessageEvent("user", "hi"),)
    placement: None = None
    notes: Mapping[str, str] = field(default_factory=dict)

    @property
    def sent(self) -> Sent:
        return Sent(self.request_id, self.target, "provider", {}, b"body")


class FakeTarget:
    """Records every stage; fails as told."""

    def __init__(self, log: list[str], fail: Exception | None = None, retry: bool = False) -> None:
        self.log, self.fail, self.can_retry = log, fail, retry

    @contextmanager
    def _admitted(self) -> Iterator[None]:
        self.log.append("admit")
        try:
            yield
        finally:
            self.log.append("release")

    def admission(self, call: Call) -> AbstractContextManager[None]:
        return self._admitted()

    async def prepare(self, name: str, call: Call) -> FakePrepared:
        self.log.append(f"prepare {name} {call.request_id}")
        return FakePrepared(name, call.request_id, notes={"x-vcache-note": name})

    async def send(self, p: FakePrepared, session: str | None) -> Pieces:
        self.log.append(f"send {p.request_id}")
        if self.fail is not None:
            fail, self.fail = self.fail, None if self.can_retry else self.fail
            raise fail
        yield Piece("hello ")
        yield Piece("world", "stop")
        yield Piece(usage=Usage.of(10, 2, 4))

    def retry(self, p: FakePrepared, error: Exception) -> FakePrepared | None:
        self.log.append(f"retry {p.request_id}")
        return FakePrepared(p.target, f"{p.request_id}-r") if self.can_retry else None

    def settle(self, p: FakePrepared, usage: Usage) -> None:
        self.log.append(f"settle {p.request_id} cached={usage.prompt_tokens_details.cached_tokens}")


class RecordingJournal(Journal):
    def __init__(self, log: list[str]) -> None:
        super().__init__(None)
        self.events = log

    def open(self, tenant: str, header: Header, turns: Any, session: str | None) -> Any:
        self.events.append(f"open {tenant}")
        return None

    async def sent(self, op: Any, served: Any, request_id: str, *rest: Any) -> None:
        self.events.append(f"journal {request_id}")

    async def answered(
        self,
        op: Any,
        served: Any,
        request_id: str,
        text: str,
        usage: Usage,
        calls: Any = None,
        thinking: Any = None,
    ) -> None:
        self.events.append(f"answered {request_id} {text!r}")


def _call() -> Call:
    req = ChatCompletionRequest(model="m", messages=[ChatMessage(role="user", content="hi")])
    return Call(req, Principal(tenant="t"), "chatcmpl-1")


def _run(targets: dict[str, FakeTarget], log: list[str], names: list[str]) -> tuple[Any, ...]:
    loop = ServiceLoop(RecordingJournal(log), Metrics(), lambda name: targets[name])
    served = Served()

    async def main() -> tuple[str, list[Piece]]:
        rid, pieces = await loop.first_answer(names, _call(), served)
        async with aclosing(pieces):
            return rid, [p async for p in pieces]

    rid, pieces = asyncio.run(main())
    return rid, pieces, served


def test_stages_run_in_order_and_the_answer_is_journaled_before_its_usage() -> None:
    log: list[str] = []
    rid, pieces, served = _run({"a": FakeTarget(log)}, log, ["a"])
    assert log == [
        "admit",
        "prepare a chatcmpl-1",
        "open t",
        "journal chatcmpl-1",
        "send chatcmpl-1",
        "answered chatcmpl-1 'hello world'",
        "settle chatcmpl-1 cached=4",
        "release",
    ]
    assert rid == "chatcmpl-1" and [p.text for p in pieces] == ["hello ", "world", ""]
    assert served.target == "a" and served.headers()["x-vcache-note"] == "a"


def test_a_target_that_fails_before_the_first_token_gives_way() -> None:
    log: list[str] = []
    targets = {"a": FakeTarget(log, Unavailable("down")), "b": FakeTarget(log)}
    rid, _, served = _run(targets, log, ["a", "b"])
    assert rid == "chatcmpl-1-1"  # the fallback is a request of its own
    assert served.target == "b" and served.fallback_from == ("a",)
    assert "journal chatcmpl-1" in log and "journal chatcmpl-1-1" in log
    assert log.count("release") == 2  # the failed target's admission was released


def test_client_mistakes_do_not_fall_back() -> None:
    log: list[str] = []
    targets = {"a": FakeTarget(log, InvalidRequest("bad", param="x")), "b": FakeTarget(log)}
    with pytest.raises(InvalidRequest):
        _run(targets, log, ["a", "b"])
    assert not any(e.startswith("prepare b") for e in log)


def test_a_retry_is_prepared_again_and_journaled_as_its_own_dispatch() -> None:
    log: list[str] = []
    _, pieces, _ = _run({"a": FakeTarget(log, BadGateway("gone"), retry=True)}, log, ["a"])
    assert [e for e in log if e.startswith(("journal", "send", "retry", "settle"))] == [
        "journal chatcmpl-1",
        "send chatcmpl-1",
        "retry chatcmpl-1",
        "journal chatcmpl-1-r",
        "send chatcmpl-1-r",
        "settle chatcmpl-1-r cached=4",
    ]
    assert pieces[-1].usage is not None


def test_settled_even_when_the_client_leaves_after_the_usage() -> None:
    log: list[str] = []
    loop = ServiceLoop(RecordingJournal(log), Metrics(), lambda name: FakeTarget(log))

    async def main() -> None:
        _, pieces = await loop.first_answer(["a"], _call(), Served())
        async for p in pieces:
            if p.usage is not None:
                break  # the client goes away with the usage, before the stream's end
        await pieces.aclose()

    asyncio.run(main())
    assert "settle chatcmpl-1 cached=4" in log and log[-1] == "release"
