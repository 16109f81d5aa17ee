"""The emulator's shared state: an injectable clock, prefix caches, faults, a request log.

Token model: a prompt is a byte stream; a token is 4 bytes of it (the last one
may be shorter).  Each provider module builds the stream the way its API
orders a prompt (tools → system → messages) from the JSON it received, key
order kept, so a client that reorders keys or rewrites a timestamp changes the
stream exactly where it would change a real provider's tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .batch_book import BatchBook
from .limits import Bill, RateLimit, RuleOverride, limit_headers

BYTES_PER_TOKEN = 4


def tokens(data: bytes) -> int:
    return -(-len(data) // BYTES_PER_TOKEN)


def compact(value: Any) -> bytes:
    """JSON as received (key order kept), without whitespace."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


class Clock:
    """Monotonic time, running ``scale`` times faster than real time (a load test can
    play hours of TTLs in minutes), plus an offset the admin API can advance."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self._start = time.monotonic()
        self._offset = 0.0

    def now(self) -> float:
        return self._start + (time.monotonic() - self._start) * self.scale + self._offset

    def advance(self, seconds: float) -> None:
        self._offset += seconds


@dataclass
class Entry:
    tokens: int
    ttl_s: float
    expires: float


class PrefixStore:
    """One cache shard: prefix key → entry, LRU beyond ``capacity``, TTL on the clock."""

    def __init__(self, clock: Clock, capacity: int) -> None:
        self._clock = clock
        self._capacity = capacity
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()

    def read(self, key: bytes) -> Entry | None:
        """A hit refreshes the entry's TTL and recency."""
        e = self._entries.get(key)
        if e is None:
            return None
        now = self._clock.now()
        if e.expires <= now:
            del self._entries[key]
            return None
        e.expires = now + e.ttl_s
        self._entries.move_to_end(key)
        return e

    def write(self, key: bytes, n_tokens: int, ttl_s: float) -> None:
        now = self._clock.now()
        old = self._entries.get(key)
        ttl = max(ttl_s, old.ttl_s) if old is not None and old.expires > now else ttl_s
        self._entries[key] = Entry(n_tokens, ttl, now + ttl)
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def flush(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class ShardedStore:
    """Several shards; a request reaches one by a hash of its routing key."""

    def __init__(self, clock: Clock, shards: int, capacity: int) -> None:
        self.shards = [PrefixStore(clock, capacity) for _ in range(shards)]

    def shard(self, route: bytes) -> PrefixStore:
        h = int.from_bytes(hashlib.sha256(route).digest()[:8], "big")
        return self.shards[h % len(self.shards)]

    def flush(self) -> None:
        for s in self.shards:
            s.flush()


def prefix_keys(salt: bytes, stream: bytes, cuts: Sequence[int]) -> list[tuple[int, bytes]]:
    """(cut in tokens, key) for each cut: the sha256 of the salt and the stream up to it."""
    out: list[tuple[int, bytes]] = []
    h = hashlib.sha256(salt)
    pos = 0
    for cut in sorted(cuts):
        end = min(len(stream), cut * BYTES_PER_TOKEN)
        h.update(stream[pos:end])
        pos = end
        out.append((cut, h.copy().digest()))
    return out


@dataclass(frozen=True)
class Piece:
    """Part of a prompt: its bytes, and its tokens when they are not 4 bytes a token
    (a message that carries an image: the image counts by the provider's rule)."""

    data: bytes
    weight: int | None = None


class TokenStream:
    """A prompt of pieces, cut in tokens.  Text runs count 4 bytes a token (a stream of
    text only counts exactly as :func:`tokens` of its bytes); a weighed piece is whole:
    a cut inside it keys on all of its bytes, so its image must be identical for a hit."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self.data = b"".join(p.data for p in pieces)
        # per piece: (end byte, end token, where its text run began: byte, token; None
        # for a weighed piece, which a cut inside keys on whole)
        self._spans: list[tuple[int, int, tuple[int, int] | None]] = []
        pos = tok = 0
        run = (0, 0)
        for p in pieces:
            pos += len(p.data)
            if p.weight is None:
                tok = run[1] + tokens(self.data[run[0] : pos])
                self._spans.append((pos, tok, run))
            else:
                tok += p.weight
                self._spans.append((pos, tok, None))
                run = (pos, tok)
        self.total = tok

    def ends(self) -> list[int]:
        """The token count at the end of each piece."""
        return [t for _, t, _ in self._spans]

    def byte_end(self, cut: int) -> int:
        """Where the prefix of ``cut`` tokens ends in the bytes."""
        for end_pos, end_tok, run in self._spans:
            if cut <= end_tok:
                if run is None:
                    return end_pos
                return min(end_pos, run[0] + (cut - run[1]) * BYTES_PER_TOKEN)
        return len(self.data)

    def keys(self, salt: bytes, cuts: Sequence[int]) -> list[tuple[int, bytes]]:
        """(cut, key) for each cut: the sha256 of the salt and the bytes up to it."""
        out: list[tuple[int, bytes]] = []
        h = hashlib.sha256(salt)
        pos = 0
        for cut in sorted(cuts):
            end = max(pos, self.byte_end(cut))
            h.update(self.data[pos:end])
            pos = end
            out.append((cut, h.copy().digest()))
        return out


def implicit_lookup(store: PrefixStore, keys: Sequence[tuple[int, bytes]]) -> int:
    """The longest cached cut, in tokens (0: a miss)."""
    for cut, key in sorted(keys, reverse=True):
        if store.read(key) is not None:
            return cut
    return 0


def implicit_write(store: PrefixStore, keys: Sequence[tuple[int, bytes]], ttl_s: float) -> None:
    for cut, key in keys:
        store.write(key, cut, ttl_s)


@dataclass
class Fault:
    """Applied to the next ``count`` requests (of ``provider``, or of any)."""

    kind: str  # status | timeout | drop | cut | garbage (a 200 of the wrong shape)
    count: int = 1
    provider: str | None = None
    status: int = 500
    retry_after: str | None = None  # the Retry-After header, as sent
    retry_after_ms: int | None = None
    delay_s: float = 30.0  # timeout: how long to stall before answering
    after_events: int = 2  # cut: events sent before the connection drops


@dataclass
class Received:
    provider: str
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Seen:
    """An image or a document a provider received: what tests compare with what was sent."""

    provider: str
    sha256: str  # of the decoded bytes
    media_type: str
    size: int
    detail: str | None  # OpenAI's, as sent
    tokens: int  # what it cost, by the provider's rule


@dataclass
class EmulatorState:
    clock: Clock = field(default_factory=Clock)
    shards: int = 4
    capacity: int = 4096
    api_key: str | None = None  # None: any non-empty key is accepted
    answer_words: int = 12  # an answer's length when the request's limit allows it
    faults: list[Fault] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    last_body: bytes = b""  # the last request's body, whole (for tests to read)
    # every image and document received, in order (sha256 of the decoded bytes)
    media: list[Seen] = field(default_factory=list)
    stores: dict[str, ShardedStore] = field(default_factory=dict)
    gemini_cached: dict[str, Any] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    rules: dict[str, RuleOverride] = field(default_factory=dict)
    limits: dict[str, RateLimit] = field(default_factory=dict)
    bills: dict[str, Bill] = field(default_factory=dict)
    batch_book: BatchBook = field(default_factory=BatchBook)  # the batch APIs' files and jobs

    def rule(self, provider: str) -> RuleOverride:
        return self.rules.get(provider) or RuleOverride()

    def bill(self, provider: str) -> Bill:
        return self.bills.setdefault(provider, Bill())

    def admit(self, provider: str, tokens: int) -> float | None:
        """Count the request against the provider's rate limit: None when admitted,
        else the real seconds until it would fit (a 429, counted on the bill)."""
        limit = self.limits.get(provider)
        if limit is None:
            return None
        wait = limit.admit(self.clock.now(), tokens)
        if wait is None:
            return None
        self.bill(provider).rejected_429 += 1
        return wait / self.clock.scale

    def limit_headers(self, provider: str) -> dict[str, str]:
        return limit_headers(provider, self.limits.get(provider), self.clock.now())

    def store(self, provider: str) -> ShardedStore:
        if provider not in self.stores:
            self.stores[provider] = ShardedStore(self.clock, self.shards, self.capacity)
        return self.stores[provider]

    def flush(self) -> None:
        for s in self.stores.values():
            s.flush()
        self.gemini_cached.clear()

    def take_fault(self, provider: str) -> Fault | None:
        for f in self.faults:
            if f.provider in (None, provider):
                f.count -= 1
                if f.count <= 0:
                    self.faults.remove(f)
                return f
        return None

    def log(self, provider: str, path: str, body: bytes) -> None:
        self.last_body = body
        self.received.append(Received(provider, path, hashlib.sha256(body).hexdigest(), len(body)))
