"""An OpenAI event stream's ``[DONE]`` goes out with the chunked body's end (one ASGI
message, so one write); the events of one piece, yielded together, in one message; a
stream that failed after it started ends with its error event and no ``[DONE]``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from pydantic import BaseModel

from gateway.core.errors import APIError
from gateway.http.sse import DONE, open_stream


class Item(BaseModel):
    n: int


Events = AsyncGenerator[Sequence[BaseModel], None]  # each item: one piece's events


async def _items(n: int, fail: bool = False) -> Events:
    for i in range(n):
        yield [Item(n=i)]
    if fail:
        raise APIError("the engine went away", code="engine_unavailable")


async def _messages(stream: Events) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    response = await open_stream(stream)
    await response.stream_response(send)
    return sent


def test_done_rides_with_the_end_of_the_body() -> None:
    sent = asyncio.run(_messages(_items(2)))
    assert sent[0]["type"] == "http.response.start"
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b'data: {"n":0}\n\n', True),
        (b'data: {"n":1}\n\n', True),
        (DONE, False),
    ]


def test_a_stream_that_fails_ends_with_its_error_and_no_done() -> None:
    sent = asyncio.run(_messages(_items(1, fail=True)))
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[0] == b'data: {"n":0}\n\n'
    assert b"engine_unavailable" in bodies[1] and sent[2]["more_body"] is True
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert DONE not in b"".join(bodies)


def test_the_events_of_one_piece_are_one_message() -> None:
    async def pieces() -> Events:
        yield [Item(n=0), Item(n=1)]  # one piece's
        yield [Item(n=2)]

    sent = asyncio.run(_messages(pieces()))
    assert [m["body"] for m in sent[1:]] == [
        b'data: {"n":0}\n\ndata: {"n":1}\n\n',
        b'data: {"n":2}\n\n',
        DONE,
    ]
