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


class SSEDecoder:
    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None

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
            if b == 0x0A:  # \n
                return i, 1
            if b == 0x0D:  # \r or \r\n
                if i + 1 < len(self._buffer):
                    return i, 2 if self._buffer[i + 1] == 0x0A else 1
                return None  # a lone \r at the end may be half of \r\n
        return None

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
