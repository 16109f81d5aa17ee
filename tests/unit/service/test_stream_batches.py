"""Each streamed API yields the events of one piece of the answer together (one write
each): the stream's opening events with the first piece's, the closing ones with the
last's, every piece between on its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from gateway.core.outputs import Usage
from gateway.core.pieces import Piece, Pieces
from gateway.core.responses_wire import ResponsesRequest
from gateway.core.shaping import Shape, chat_chunks
from gateway.service.message_answers import stream_events
from gateway.service.response_answers import ResponseStream

PIECES = (
    Piece("hel", prompt_tokens=5, cached_tokens=0),
    Piece("lo", "stop"),
    Piece(usage=Usage.of(5, 2, 0)),
)


async def _pieces() -> Pieces:
    for p in PIECES:
        yield p


def _batches(stream: AsyncGenerator[Sequence[Any], None]) -> list[list[Any]]:
    async def collect() -> list[list[Any]]:
        return [list(batch) async for batch in stream]

    return asyncio.run(collect())


def test_chat_chunks_come_a_piece_at_a_time_the_role_with_the_first() -> None:
    shape = Shape(include_usage=True)
    batches = _batches(chat_chunks("c1", "m", _pieces(), shape))
    deltas = [
        [(c.choices[0].delta.role, c.choices[0].delta.content) for c in b if c.choices]
        for b in batches
    ]
    assert deltas == [[("assistant", ""), (None, "hel")], [(None, "lo")], []]
    assert batches[1][0].choices[0].finish_reason == "stop"
    assert [c.usage is not None for c in batches[2]] == [True]


def test_anthropic_events_come_a_piece_at_a_time_the_start_and_stop_with_their_pieces() -> None:
    batches = _batches(stream_events("msg_1", "m", _pieces()))
    assert [[e.type for e in b] for b in batches] == [
        ["message_start", "ping", "content_block_start", "content_block_delta"],
        ["content_block_delta"],
        ["content_block_stop", "message_delta", "message_stop"],
    ]


def test_anthropic_events_of_an_answer_without_pieces_still_start_and_stop() -> None:
    async def none() -> Pieces:
        return
        yield

    batches = _batches(stream_events("msg_1", "m", none()))
    assert [[e.type for e in b] for b in batches] == [["message_start", "ping"], ["message_stop"]]


def test_response_events_come_a_piece_at_a_time_numbered_in_order() -> None:
    req = ResponsesRequest(model="m", input="hi", stream=True)
    batches = _batches(ResponseStream("resp_1", req, 0).events(_pieces()))
    assert [[e.type for e in b] for b in batches] == [
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
        ],
        ["response.output_text.delta"],
        ["response.output_text.done", "response.content_part.done", "response.output_item.done"],
    ]
    numbers = [e.sequence_number for b in batches for e in b]
    assert numbers == list(range(len(numbers)))
