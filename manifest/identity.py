"""A vBlock's identity: every axis that must match for a cache to be reused.

A provider or engine serves a cached prefix only when the content *and* the
model, tokenizer, serializer and the silent vary axes (endpoint, reasoning
mode, tenant salt) are all the same.  Identity keys on all of them, plus the
block's place in the prefix DAG (its parent), so two units that render the
same bytes under different models never alias.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NewType

import cbor2

ModelId = NewType("ModelId", str)
TokenizerId = NewType("TokenizerId", str)
SerializerId = NewType("SerializerId", str)
TenantId = NewType("TenantId", str)
ContentDigest = NewType("ContentDigest", str)  # hex sha256 of canonical bytes
VBlockId = NewType("VBlockId", str)  # hex sha256 of the whole identity

CANONICAL_SERIALIZER = SerializerId("vcache-canonical-json/1")


def content_digest(data: bytes) -> ContentDigest:
    return ContentDigest(hashlib.sha256(data).hexdigest())


def prefix_digests(data: bytes, ends: Iterable[int], head: bytes = b"") -> dict[int, ContentDigest]:
    """``content_digest(head + data[:e])`` for every ``e`` in ``ends``, in one pass over
    ``data`` (the hash state is copied at each end), so a prompt's boundaries cost its
    length once, not once per boundary."""
    h = hashlib.sha256(head)
    view = memoryview(data)
    out: dict[int, ContentDigest] = {}
    at = 0
    for e in sorted(set(ends)):
        if not 0 <= e <= len(view):
            raise ValueError(f"end {e} lies outside {len(view)} bytes")
        h.update(view[at:e])
        at = e
        out[e] = ContentDigest(h.copy().hexdigest())
    return out


@dataclass(frozen=True)
class VaryAxes:
    """Silent cache-breakers: a change in any of them is a different cache."""

    endpoint: str = "chat"
    reasoning_mode: str | None = None
    cache_salt: str | None = None  # carries the tenant


@dataclass(frozen=True)
class VBlockIdentity:
    content: ContentDigest
    model: ModelId
    tokenizer: TokenizerId
    serializer: SerializerId = CANONICAL_SERIALIZER
    vary: VaryAxes = VaryAxes()
    parent: VBlockId | None = None

    def __post_init__(self) -> None:
        if len(self.content) != 64:
            raise ValueError("content must be a hex sha256 digest")

    @property
    def id(self) -> VBlockId:
        fields = (
            self.content,
            self.model,
            self.tokenizer,
            self.serializer,
            self.vary.endpoint,
            self.vary.reasoning_mode,
            self.vary.cache_salt,
            self.parent,
        )
        return VBlockId(hashlib.sha256(cbor2.dumps(fields, canonical=True)).hexdigest())

    def child(self, content: ContentDigest) -> VBlockIdentity:
        """The next unit in the prefix chain: same axes, this block as parent."""
        return VBlockIdentity(
            content=content,
            model=self.model,
            tokenizer=self.tokenizer,
            serializer=self.serializer,
            vary=self.vary,
            parent=self.id,
        )
