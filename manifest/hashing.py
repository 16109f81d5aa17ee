"""Block hashes bit-identical to vLLM's prefix cache (``sha256_cbor``).

vLLM (``vllm.v1.core.kv_cache_utils``) hashes every *full* block of a prompt
as ``sha256(cbor_canonical((parent, tuple(tokens), extra_keys)))``, where the
first block's parent is ``NONE_HASH = sha256(cbor_canonical(seed))`` and
``seed`` is the engine's ``PYTHONHASHSEED`` string.  Extra keys are tagged
tuples: ``("lora", name, path)`` on every block of a LoRA request, then
``("mm", identifier, offset)`` on every block that overlaps a multimodal item's
placeholder range (``offset``: where the item starts, relative to the block's first
token, negative when it started in an earlier block), then ``("cache_salt", salt)`` on
the first block only; ``None`` when there are none.

KV events carry either the full 32 bytes or, with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the low 64 bits as an integer:
:func:`event_hash`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import cbor2

BlockHash = NewType("BlockHash", bytes)
"""32 bytes: the hash of a full block and, through its parent, of every block before it."""

EventHash = NewType("EventHash", int)
"""The low 64 bits of a :data:`BlockHash`, as vLLM's KV events carry it."""

ExtraKey = tuple[str, ...]
MMKey = tuple[str, str, int]


def sha256_cbor(obj: object) -> bytes:
    """vLLM's ``vllm.utils.hashing.sha256_cbor``."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def root_hash(seed: str) -> BlockHash:
    """The parent of every first block (vLLM's ``NONE_HASH``) for ``PYTHONHASHSEED=seed``."""
    return BlockHash(sha256_cbor(seed))


def event_hash(h: bytes) -> EventHash:
    """The integer form KV events carry: the low 64 bits of the big-endian hash."""
    return EventHash(int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF)


def to_hex(h: BlockHash) -> str:
    return h.hex()


def from_hex(text: str) -> BlockHash:
    raw = bytes.fromhex(text)
    if len(raw) != 32:
        raise ValueError(f"a block hash is 32 bytes, got {len(raw)}")
    return BlockHash(raw)


@dataclass(frozen=True)
class MMSpan:
    """One multimodal item in a prompt: its identifier (vLLM's ``mm_hash``) and the
    tokens its placeholder occupies (vLLM's ``PlaceholderRange``: ``offset``, ``length``)."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class HashKeys:
    """What besides tokens enters a block's hash: the engine's isolation axes and the
    prompt's multimodal items (sorted by offset, as vLLM keeps them)."""

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    mm: tuple[MMSpan, ...] = ()

    def for_block(self, index: int, block_size: int = 0) -> tuple[ExtraKey | MMKey, ...] | None:
        keys: list[ExtraKey | MMKey] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path or ""))
        start, end = index * block_size, (index + 1) * block_size
        for item in self.mm:
            if item.offset < end and start < item.offset + item.length:
                keys.append(("mm", item.identifier, item.offset - start))
        if index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) or None


def hash_block(
    parent: BlockHash, tokens: Sequence[int], extra: tuple[ExtraKey | MMKey, ...] | None
) -> BlockHash:
    return BlockHash(sha256_cbor((parent, tuple(tokens), extra)))


BlockKey = tuple[BlockHash, tuple[int, ...], tuple[ExtraKey | MMKey, ...] | None]


class HashMemo:
    """Block hashes computed already, by what a block's hash is computed from (its
    parent, its tokens, its extra keys): the prompts of one application share their
    system prompt's blocks, each hashed once rather than once a request.  At most
    ``capacity`` blocks (the default: 262,144 tokens of distinct prefixes, ~14 MB), the
    least recently used forgotten first.  Not thread-safe: one owner."""

    def __init__(self, capacity: int = 16384) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._known: dict[BlockKey, BlockHash] = {}
        self._roots: dict[str, BlockHash] = {}  # by seed: every prompt's chain starts there
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._known)

    def root(self, seed: str) -> BlockHash:
        """:func:`root_hash` of ``seed``, computed once."""
        h = self._roots.get(seed)
        if h is None:
            h = self._roots[seed] = root_hash(seed)
        return h

    def hash(self, key: BlockKey) -> BlockHash:
        """The hash of the block ``key`` names (vLLM's ``hash_block_tokens``)."""
        known = self._known
        h = known.pop(key, None)
        if h is None:
            self.misses += 1
            h = BlockHash(sha256_cbor(key))
            if len(known) >= self.capacity:
                del known[next(iter(known))]  # the least recently used (dicts keep order)
        else:
            self.hits += 1
        known[key] = h  # the most recently used last
        return h


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: str,
    keys: HashKeys | None = None,
    memo: HashMemo | None = None,
) -> list[BlockHash]:
    """The hash of every full block of ``token_ids``, as vLLM computes them (``memo``:
    the blocks hashed already, taken from it and added to it)."""
    chain = BlockChain(block_size=block_size, seed=seed, keys=keys or HashKeys(), memo=memo)
    chain.extend(token_ids)
    return list(chain.hashes)


@dataclass
class BlockChain:
    """Incremental hashing for a growing sequence: only new full blocks are hashed.

    ``extend`` appends tokens; ``hashes`` holds one hash per full block so far.
    A conversation that grows turn by turn hashes each block exactly once.
    """

    block_size: int
    seed: str
    keys: HashKeys = field(default_factory=HashKeys)
    hashes: list[BlockHash] = field(default_factory=list)
    memo: HashMemo | None = field(default=None, repr=False, compare=False)
    _pending: list[int] = field(default_factory=list, repr=False)
    _root: BlockHash = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        self._root = root_hash(self.seed) if self.memo is None else self.memo.root(self.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size + len(self._pending)

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Append tokens; return the hashes of the blocks this call completed."""
        pending = self._pending
        pending.extend(token_ids)
        bs = self.block_size
        full = len(pending) // bs
        new: list[BlockHash] = []
        parent = self.hashes[-1] if self.hashes else self._root
        first = len(self.hashes)
        memo, plain = self.memo, not self.keys.lora_name and not self.keys.mm
        for i in range(full):
            tokens = pending[i * bs : (i + 1) * bs]
            # no lora, no images: only the first block has extra keys (the salt)
            extra = self.keys.for_block(first + i, bs) if i + first == 0 or not plain else None
            if memo is not None:
                parent = memo.hash((parent, tuple(tokens), extra))
            else:
                parent = hash_block(parent, tokens, extra)
            new.append(parent)
        del pending[: full * bs]
        self.hashes.extend(new)
        return new


def segment_digest(data: bytes) -> str:
    """Content digest of canonical bytes (the provider regime's unit of identity)."""
    return hashlib.sha256(data).hexdigest()
