"""The SSE decoder, fed chunk by chunk."""

from __future__ import annotations

import pytest

from engines.sse import ServerSentEvent, SSEDecoder

STREAM = (
    b": keep-alive\n\n"
    b'data: {"a": 1}\n\n'
    b"event: message_delta\r\nid: 7\r\ndata: line one\r\ndata: line two\r\n\r\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    ServerSentEvent('{"a": 1}'),
    ServerSentEvent("line one\nline two", "message_delta", "7"),
    ServerSentEvent("[DONE]", None, "7"),
]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(STREAM)])
def test_any_chunking_gives_the_same_events(size: int) -> None:
    dec = SSEDecoder()
    events = []
    for i in range(0, len(STREAM), size):
        events += dec.feed(STREAM[i : i + size])
    assert events == EXPECTED


def test_incomplete_event_waits_for_its_blank_line() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: partial") == []
    assert dec.feed(b"\n") == []
    assert dec.feed(b"\n") == [ServerSentEvent("partial")]


def test_utf8_split_across_chunks() -> None:
    raw = "data: caché\n\n".encode()
    dec = SSEDecoder()
    split = raw.index("é".encode()) + 1
    assert dec.feed(raw[:split]) == []
    assert dec.feed(raw[split:]) == [ServerSentEvent("caché")]
