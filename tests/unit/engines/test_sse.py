"""The SSE decoder, fed chunk by chunk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


class _ByteLoopDecoder(SSEDecoder):
    """The decoder as first written, a Python loop per byte: the oracle for line ends."""

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        self._buffer += chunk
        out: list[ServerSentEvent] = []
        while True:
            cut = self._next_line_end()
            if cut is None:
                return out
            end, width = cut
            line = self._buffer[:end].decode("utf-8")
            self._buffer = self._buffer[end + width :]
            event = self._line(line)
            if event is not None:
                out.append(event)

    def _next_line_end(self) -> tuple[int, int] | None:
        for i, b in enumerate(self._buffer):
            if b == 0x0A:
                return i, 1
            if b == 0x0D:
                if i + 1 < len(self._buffer):
                    return i, 2 if self._buffer[i + 1] == 0x0A else 1
                return None
        return None


_FIELDS = st.sampled_from(["data: ", "data:", "event: ", "id: ", ": ", ""])
_TEXT = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]))
_ENDS = st.sampled_from(["\n", "\r", "\r\n"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_FIELDS, _TEXT, _ENDS), max_size=12),
    st.lists(st.integers(1, 9), min_size=1, max_size=8),
)
def test_line_ends_match_the_byte_loop(lines: list[tuple[str, str, str]], sizes: list[int]) -> None:
    """Any mix of \\n, \\r and \\r\\n (a \\r\\n split across two chunks too), in any
    chunking: the same events as the byte-by-byte decoder, in the same order."""
    raw = "".join(f + t + e for f, t, e in lines).encode() + b"\n\n"
    fast, slow = SSEDecoder(), _ByteLoopDecoder()
    got: list[ServerSentEvent] = []
    want: list[ServerSentEvent] = []
    at, i = 0, 0
    while at < len(raw):
        piece = raw[at : at + sizes[i % len(sizes)]]
        got += fast.feed(piece)
        want += slow.feed(piece)
        at, i = at + len(piece), i + 1
    assert got == want
