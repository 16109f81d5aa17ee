"""The control endpoint's wire form and its loopback rule."""

from __future__ import annotations

from engines.vllm.control import _loopback, from_wire, to_wire


def test_bytes_round_trip_inside_structures() -> None:
    value = {"pinned": [b"\x00\xff", b"ab"], "n": 3, "nested": [[b"x"], "text"]}
    wire = to_wire(value)
    assert wire["pinned"][0] == {"$bytes": "00ff"}
    assert from_wire(wire) == value


def test_loopback_only() -> None:
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("127.5.6.7")
    assert not _loopback("10.0.0.7") and not _loopback(None) and not _loopback("testclient")
