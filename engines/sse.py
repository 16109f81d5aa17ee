"""A sans-I/O decoder for server-sent events (text/event-stream).

Feed it bytes as they arrive, in chunks of any size; it returns the complete
events so far.  Shared by every adapter that reads a streamed HTTP response.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSentEvent:
    data: str
    event: str | None = None
    id: str | None = None


def _line_end(buf: bytes, start: int) -> tuple[int, int] | None:
    """The first line end at or after ``start``: (offset, width) of ``\n``, ``\r\n`` or
    ``\r``; None when none is complete yet.  Found with ``bytes.find`` (a C scan); a
    UTF-8 character never contains either byte, so lines split safely before decoding."""
    lf = buf.find(b"\n", start)
    cr = buf.find(b"\r", start, lf if lf >= 0 else len(buf))
    if cr < 0:
        return None if lf < 0 else (lf, 1)
    if cr + 1 < len(buf):
        return cr, 2 if buf[cr + 1] == 0x0A else 1
    return None  # a lone \r at the end may be half of \r\n


class SSEDecoder:
    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        buf = self._buffer + chunk if self._buffer else chunk
        out: list[ServerSentEvent] = []
        start = 0
        while (cut := _line_end(buf, start)) is not None:
            end, width = cut
            event = self._line(buf[start:end].decode("utf-8"))
            start = end + width
            if event is not None:
                out.append(event)
        self._buffer = buf[start:]  # the partial line, kept for the next chunk
        return out

    def _line(self, line: str) -> ServerSentEvent | None:
        if line == "":
            if not self._data and self._event is None:
                return None
            event = ServerSentEvent("\n".join(self._data), self._event, self._id)
            self._data, self._event = [], None
            return event
        if line.startswith(":"):
            return None  # a comment (keep-alive)
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        return None
