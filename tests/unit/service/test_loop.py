"""The one service loop over in-memory targets: the order of its stages, fallback
before the first token, a retry prepared again and journaled as its own dispatch,
the answer journaled before its usage goes out, and what a target acquired given
back on every path."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.core.config import RoutingSettings
from gateway.core.errors import BadGateway, InvalidRequest, Unavailable
from gateway.core.metrics import Metrics
from gateway.core.outputs import Usage
from gateway.core.pieces import Piece, Pieces
from gateway.core.schemas import ChatCompletionRequest, ChatMessage
from gateway.core.target import Call, Quote, Sent
from gateway.core.types import Principal, Served
from gateway.service.journal import Journal
from manifest.sessionlog import Header, MessageEvent
from tests.unit import builders


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

    def __init__(
        self,
        log: list[str],
        fail: Exception | None = None,
        retry: bool = False,
        cached: float | None = 0.0,
        price: float = 1.0,
        stall: bool = False,
    ) -> None:
        self.log, self.fail, self.can_retry = log, fail, retry
        self.stall = stall  # the send waits for ever before its first piece
        self.sending = asyncio.Event()
        self.cached, self.price = cached, price  # cached None: it cannot quote
        self.claims: set[str] = set()  # what acquire claimed and release has not given back

    @contextmanager
    def _admitted(self) -> Iterator[None]:
        self.log.append("admit")
        try:
            yield
        finally:
            self.log.append("release")

    def admission(self, call: Call) -> AbstractContextManager[None]:
        return self._admitted()

    async def quote(self, name: str, call: Call) -> Quote[str] | None:
        self.log.append(f"quote {name}")
        if self.cached is None:
            return None
        return Quote(name, 1000, self.cached, self.price, 0.1, memo=f"memo {name}")

    async def prepare(self, name: str, call: Call, quote: Quote[str] | None = None) -> FakePrepared:
        memo = f" ({quote.memo})" if quote is not None else ""
        self.log.append(f"prepare {name} {call.request_id}{memo}")
        return FakePrepared(name, call.request_id, notes={"x-vcache-note": name})

    async def acquire(self, p: FakePrepared) -> FakePrepared:
        self.log.append(f"acquire {p.request_id}")
        self.claims.add(p.request_id)
        return p

    def release(self, p: FakePrepared) -> None:
        if p.request_id in self.claims:
            self.claims.discard(p.request_id)
            self.log.append(f"give back {p.request_id}")

    async def send(self, p: FakePrepared, session: str | None) -> Pieces:
        self.log.append(f"send {p.request_id}")
        self.sending.set()
        if self.stall:
            await asyncio.Event().wait()
        if self.fail is not None:
            fail, self.fail = self.fail, None if self.can_retry else self.fail
            raise fail
        yield Piece("hello ")
        yield Piece("world", "stop")
        yield Piece(usage=Usage.of(10, 2, 4))

    def retry(self, p: FakePrepared, error: Exception) -> FakePrepared | None:
        self.log.append(f"retry {p.request_id}")
        if not self.can_retry:
            return None
        self.claims.add(f"{p.request_id}-r")  # the same claims, under the retry's id
        self.claims.discard(p.request_id)
        return FakePrepared(p.target, f"{p.request_id}-r")

    def settle(self, p: FakePrepared, usage: Usage) -> None:
        self.log.append(f"settle {p.request_id} cached={usage.prompt_tokens_details.cached_tokens}")


class RecordingJournal(Journal):
    def __init__(self, log: list[str]) -> None:
        super().__init__(None)
        self.events = log

    def open(self, tenant: str, header: Header, turns: Any, session: str | None) -> Any:
        self.events.append(f"open {tenant}")
        return None

    async def sent(self, op: Any, request_id: str, *rest: Any) -> None:
        self.events.append(f"journal {request_id}")

    async def answered(
        self,
        op: Any,
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


def _run(
    targets: dict[str, FakeTarget],
    log: list[str],
    names: list[str],
    routing: RoutingSettings | None = None,
) -> tuple[Any, ...]:
    loop = builders.loop(RecordingJournal(log), Metrics(), lambda name: targets[name], routing)

    async def main() -> tuple[str, list[Piece], Served]:
        routed = await loop.first_answer(names, _call())
        async with aclosing(routed.body.pieces) as pieces:
            return routed.body.id, [p async for p in pieces], routed.served

    return asyncio.run(main())


def test_stages_run_in_order_and_the_answer_is_journaled_before_its_usage() -> None:
    log: list[str] = []
    rid, pieces, served = _run({"a": FakeTarget(log)}, log, ["a"])
    assert log == [
        "admit",
        "prepare a chatcmpl-1",
        "open t",
        "journal chatcmpl-1",
        "acquire chatcmpl-1",  # what waits, after the journal and before the send
        "send chatcmpl-1",
        "answered chatcmpl-1 'hello world'",
        "settle chatcmpl-1 cached=4",
        "give back chatcmpl-1",
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
    assert served.routed_by == "order"  # equal quotes: the alias's first went first
    assert "journal chatcmpl-1" in log and "journal chatcmpl-1-1" in log
    assert log.count("release") == 2  # the failed target's admission was released
    assert "give back chatcmpl-1" in log and not targets["a"].claims  # and its claims


def test_client_mistakes_do_not_fall_back() -> None:
    log: list[str] = []
    targets = {"a": FakeTarget(log, InvalidRequest("bad", param="x")), "b": FakeTarget(log)}
    with pytest.raises(InvalidRequest):
        _run(targets, log, ["a", "b"])
    assert not any(e.startswith("prepare b") for e in log)


def test_a_retry_is_prepared_again_and_journaled_as_its_own_dispatch() -> None:
    log: list[str] = []
    _, pieces, _ = _run({"a": FakeTarget(log, BadGateway("gone"), retry=True)}, log, ["a"])
    steps = ("journal", "acquire", "send", "retry", "settle", "give back")
    assert [e for e in log if e.startswith(steps)] == [
        "journal chatcmpl-1",
        "acquire chatcmpl-1",
        "send chatcmpl-1",
        "retry chatcmpl-1",
        "journal chatcmpl-1-r",  # journaled again, not acquired again: it holds the claims
        "send chatcmpl-1-r",
        "settle chatcmpl-1-r cached=4",
        "give back chatcmpl-1-r",
    ]
    assert pieces[-1].usage is not None


def test_settled_even_when_the_client_leaves_after_the_usage() -> None:
    log: list[str] = []
    loop = builders.loop(RecordingJournal(log), Metrics(), lambda name: FakeTarget(log))

    async def main() -> None:
        pieces = (await loop.first_answer(["a"], _call())).body.pieces
        async for p in pieces:
            if p.usage is not None:
                break  # the client goes away with the usage, before the stream's end
        await pieces.aclose()

    asyncio.run(main())
    assert "settle chatcmpl-1 cached=4" in log and log[-2:] == ["give back chatcmpl-1", "release"]


def test_the_claims_go_back_when_the_client_leaves_before_the_first_token() -> None:
    log: list[str] = []
    target = FakeTarget(log, stall=True)
    loop = builders.loop(RecordingJournal(log), Metrics(), lambda name: target)

    async def main() -> None:
        task = asyncio.create_task(loop.first_answer(["a"], _call()))
        await target.sending.wait()
        task.cancel()  # the client goes away while the target computes the first token
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log[-2:] == ["give back chatcmpl-1", "release"] and not target.claims


def test_a_journal_that_fails_acquires_nothing() -> None:
    log: list[str] = []

    class Failing(RecordingJournal):
        async def sent(self, op: Any, request_id: str, *rest: Any) -> None:
            raise Unavailable("the session log is unavailable", code="session_log_unavailable")

    target = FakeTarget(log)
    loop = builders.loop(Failing(log), Metrics(), lambda name: target)
    with pytest.raises(Unavailable):
        asyncio.run(loop.first_answer(["a"], _call()))
    assert log == ["admit", "prepare a chatcmpl-1", "open t", "release"] and not target.claims


# ------------------------------------------------------------ by cost


def test_a_cheaper_later_target_goes_first_and_is_prepared_on_its_quote() -> None:
    log: list[str] = []
    # b holds 900 of the 1000 prompt tokens warm: 0.1·900 + 100 = 190 vs a's 1000
    targets = {"a": FakeTarget(log), "b": FakeTarget(log, cached=900)}
    rid, _, served = _run(targets, log, ["a", "b"])
    assert log[:3] == ["quote a", "quote b", "admit"]
    assert "prepare b chatcmpl-1 (memo b)" in log and not any("prepare a" in e for e in log)
    assert rid == "chatcmpl-1" and served.target == "b"
    assert served.routed_by == "cost" and served.headers()["x-vcache-routed-by"] == "cost"


def test_the_fallback_after_the_cheapest_is_the_next_cheapest() -> None:
    log: list[str] = []
    targets = {
        "a": FakeTarget(log),
        "b": FakeTarget(log, price=0.5),
        "c": FakeTarget(log, Unavailable("down"), cached=900),
    }
    rid, _, served = _run(targets, log, ["a", "b", "c"])
    assert [e.split()[1] for e in log if e.startswith("prepare")] == ["c", "b"]
    assert served.target == "b" and served.fallback_from == ("c",) and rid == "chatcmpl-1-1"


def test_costs_within_the_margin_keep_the_alias_order() -> None:
    log: list[str] = []
    # b is 5% cheaper: inside the default 10% margin, so a (first in the alias) serves
    targets = {"a": FakeTarget(log), "b": FakeTarget(log, price=0.95)}
    _, _, served = _run(targets, log, ["a", "b"])
    assert served.target == "a" and served.routed_by == "order"
    log.clear()
    _, _, served = _run(targets, log, ["a", "b"], RoutingSettings(margin=0.01))
    assert served.target == "b" and served.routed_by == "cost"


def test_a_target_that_cannot_quote_keeps_the_alias_order() -> None:
    log: list[str] = []
    targets = {"a": FakeTarget(log, cached=None), "b": FakeTarget(log, cached=900)}
    _, _, served = _run(targets, log, ["a", "b"])
    assert served.target == "a" and served.routed_by is None
    assert "prepare a chatcmpl-1" in log  # prepared without a quote


def test_routing_by_order_quotes_nothing() -> None:
    log: list[str] = []
    targets = {"a": FakeTarget(log), "b": FakeTarget(log, cached=900)}
    _, _, served = _run(targets, log, ["a", "b"], RoutingSettings(by="order"))
    assert served.target == "a" and not any(e.startswith("quote") for e in log)


def test_a_single_target_is_not_quoted() -> None:
    log: list[str] = []
    _, _, served = _run({"a": FakeTarget(log, cached=900)}, log, ["a"])
    assert not any(e.startswith("quote") for e in log) and served.routed_by is None


def test_a_free_first_target_is_not_outbid_and_the_rest_are_not_quoted() -> None:
    log: list[str] = []
    targets = {"a": FakeTarget(log, price=0.0), "b": FakeTarget(log, cached=900)}
    _, _, served = _run(targets, log, ["a", "b"])
    assert [e for e in log if e.startswith("quote")] == ["quote a"]
    assert served.target == "a" and served.routed_by == "order"
    assert "prepare a chatcmpl-1 (memo a)" in log  # prepared on its quote
