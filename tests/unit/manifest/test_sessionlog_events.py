"""Session-log message events: thinking blocks are kept, round-trip through the event
codec, and enter a message's key only when present (older digests do not change); a
string of BLOB_MIN_BYTES UTF-8 bytes or more is stored as a blob, a shorter one inline."""

from __future__ import annotations

import hashlib

from manifest.canonical import canonical_json
from manifest.sessionlog import BLOB_MIN_BYTES, MessageEvent, decode, encode


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


# each message shape's key as the log has always written it (pinned from the key as it
# was before the groups were named): a session's digests chain these bytes
KEYS = [
    (MessageEvent("user", "hi"), '["user","hi",null]'),
    (MessageEvent("user", "hi", name="bob"), '["user","hi","bob"]'),
    (
        MessageEvent("assistant", "", tool_calls='[{"id":"c"}]'),
        '["assistant","",null,"[{\\"id\\":\\"c\\"}]",null]',
    ),
    (MessageEvent("tool", "42", tool_call_id="c"), '["tool","42",null,null,"c"]'),
    (
        MessageEvent("assistant", "ok", thinking='[{"t":1}]'),
        '["assistant","ok",null,null,null,"[{\\"t\\":1}]"]',
    ),
    (
        MessageEvent("system", "", tool_changes='[{"add":"f"}]'),
        '["system","",null,null,null,null,"[{\\"add\\":\\"f\\"}]",null]',
    ),
    (
        MessageEvent("user", "go", control='{"effort":"low"}'),
        '["user","go",null,null,null,null,null,"{\\"effort\\":\\"low\\"}"]',
    ),
    (
        MessageEvent("user", "see", parts='[{"type":"text","text":"see"}]'),
        '["user","see",null,null,null,null,null,null,"[{\\"type\\":\\"text\\",\\"text\\":\\"see\\"}]"]',
    ),
    (
        MessageEvent(
            "assistant", "x", tool_calls='[{"id":"d"}]', thinking='[{"t":2}]', control='{"e":1}'
        ),
        '["assistant","x",null,"[{\\"id\\":\\"d\\"}]",null,"[{\\"t\\":2}]",null,"{\\"e\\":1}"]',
    ),
]


def test_every_message_shape_keeps_the_key_bytes_the_log_chains() -> None:
    for m, pinned in KEYS:
        assert canonical_json(list(m.key())).decode() == pinned, m


def test_strings_become_blobs_by_their_utf8_bytes_not_their_characters() -> None:
    at_bound = "\U0001f600" * (BLOB_MIN_BYTES // 4)  # 4 bytes a character: exactly the bound
    below = "a" * (BLOB_MIN_BYTES - 1)
    wide = "\u00e9" * (BLOB_MIN_BYTES // 2 + 1)  # fewer characters than the bound, more bytes
    for content, blob in ((at_bound, True), (below, False), (wide, True), ("a" * 63, False)):
        enc = encode(MessageEvent("user", content))
        digest = hashlib.sha256(content.encode()).hexdigest()
        assert (digest in enc.blobs) is blob, len(content)
        assert (content.encode() in enc.data) is not blob
        assert _roundtrip(MessageEvent("user", content)).content == content
