"""Session-log message events: thinking blocks are kept, round-trip through the event
codec, and enter a message's key only when present (older digests do not change)."""

from __future__ import annotations

from manifest.sessionlog import MessageEvent, decode, encode


def _roundtrip(m: MessageEvent) -> MessageEvent:
    enc = encode(m)
    event = decode(enc.data, lambda sha: enc.blobs[sha])
    assert isinstance(event, MessageEvent)
    return event


def test_thinking_round_trips_and_keys_only_when_present() -> None:
    plain = MessageEvent("assistant", "hi")
    calls = MessageEvent("assistant", "", tool_calls='[{"id":"c"}]')
    thought = MessageEvent("assistant", "", tool_calls='[{"id":"c"}]', thinking='[{"t":1}]')
    assert plain.key() == ("assistant", "hi", None)
    assert len(calls.key()) == 5 and len(thought.key()) == 6
    assert thought.key()[-1] == '[{"t":1}]' and thought.key() != calls.key()
    for m in (plain, calls, thought):
        assert _roundtrip(m) == m
    assert b"thinking" not in encode(calls).data  # absent, not null: old rows read the same
