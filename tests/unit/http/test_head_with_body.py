"""A response's head goes out with its body's first bytes, in one write; a head with no
body after it in the same turn of the loop goes out at the next, and before a close."""

from __future__ import annotations

import asyncio

from gateway.http.server import HeadWithBody


class Recorder:
    """The writes a transport was asked for, one item each."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


HEAD = b"HTTP/1.1 200 OK\r\n\r\n"


def _head_written() -> tuple[Recorder, HeadWithBody]:
    """A response's transport, its head written to it (on the running loop)."""
    rec = Recorder()
    t = HeadWithBody(rec, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    return rec, t


def test_the_head_and_the_first_body_bytes_are_one_write_then_each_write_its_own() -> None:
    async def main() -> None:
        rec, t = _head_written()
        assert rec.writes == []  # held for the body
        t.write(b"data: 1\n\n")
        t.write(b"data: 2\n\n")
        assert rec.writes == [HEAD + b"data: 1\n\n", b"data: 2\n\n"]
        await asyncio.sleep(0)  # the turn's flush finds nothing held
        assert len(rec.writes) == 2

    asyncio.run(main())


def test_a_head_without_a_body_in_its_turn_goes_out_at_the_next() -> None:
    async def main() -> None:
        rec, t = _head_written()
        await asyncio.sleep(0)
        assert rec.writes == [HEAD]
        t.write(b"data: late\n\n")
        assert rec.writes[-1] == b"data: late\n\n"

    asyncio.run(main())


def test_a_close_sends_the_held_head_first() -> None:
    async def main() -> None:
        rec, t = _head_written()
        t.close()
        assert rec.writes == [HEAD] and rec.closed
        await asyncio.sleep(0)
        assert len(rec.writes) == 1  # not twice

    asyncio.run(main())


def test_a_connection_closed_meanwhile_gets_no_write() -> None:
    async def main() -> None:
        rec, _ = _head_written()
        rec.closed = True  # the client went away before the loop's next turn
        await asyncio.sleep(0)
        assert rec.writes == []

    asyncio.run(main())
