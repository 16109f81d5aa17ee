"""Oracle tests: our block hashes equal vLLM's own, bit for bit."""

from __future__ import annotations

import random

import pytest

from manifest.hashing import (
    BlockChain,
    BlockHash,
    HashKeys,
    HashMemo,
    block_hashes,
    event_hash,
    from_hex,
    root_hash,
    to_hex,
)

kv = pytest.importorskip("vllm.v1.core.kv_cache_utils")
hashing = pytest.importorskip("vllm.utils.hashing")


class _Lora:
    def __init__(self, name: str, path: str) -> None:
        self.lora_name = name
        self.lora_path = path


class _Req:
    """The fields of ``vllm.v1.request.Request`` that block hashing reads."""

    def __init__(self, tokens: list[int], salt: str | None, lora: _Lora | None) -> None:
        self.all_token_ids = tokens
        self.num_tokens = len(tokens)
        self.cache_salt = salt
        self.lora_request = lora
        self.mm_features: list[object] = []
        self.prompt_embeds = None
        self.block_hashes: list[bytes] = []


def vllm_hashes(
    tokens: list[int],
    block_size: int,
    seed: str,
    salt: str | None,
    lora: _Lora | None,
    monkeypatch: pytest.MonkeyPatch,
) -> list[bytes]:
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    kv.init_none_hash(hashing.sha256_cbor)
    hasher = kv.get_request_block_hasher(block_size, hashing.sha256_cbor)
    return list(hasher(_Req(tokens, salt, lora)))


CASES = [
    (bs, salt, lora, seed)
    for bs in (16, 64, 128)
    for salt in (None, "tenant:a")
    for lora in (None, ("adapter-x", "/loras/x"))
    for seed in ("0", "1234")
]


@pytest.mark.parametrize(("block_size", "salt", "lora", "seed"), CASES)
def test_block_hashes_equal_vllm(
    block_size: int,
    salt: str | None,
    lora: tuple[str, str] | None,
    seed: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(f"{block_size}-{salt}-{lora}-{seed}")
    for _ in range(5):
        tokens = [rng.randrange(0, 150_000) for _ in range(rng.randrange(0, 5 * block_size))]
        keys = HashKeys(
            cache_salt=salt,
            lora_name=lora[0] if lora else None,
            lora_path=lora[1] if lora else None,
        )
        ours = block_hashes(tokens, block_size, seed, keys)
        theirs = vllm_hashes(
            tokens, block_size, seed, salt, _Lora(*lora) if lora else None, monkeypatch
        )
        assert len(ours) == len(tokens) // block_size
        assert ours == theirs
        # remembered: a memo shared with every other case's prompts gives the same hashes
        assert block_hashes(tokens, block_size, seed, keys, MEMO) == theirs
        assert block_hashes(tokens, block_size, seed, keys, MEMO) == theirs  # from memory


MEMO = HashMemo()  # one for every case above: salts, adapters, seeds, block sizes mixed


def test_a_memo_hashes_a_shared_prefix_once_and_keeps_its_capacity() -> None:
    system = list(range(160))  # 10 blocks every prompt shares
    memo = HashMemo(capacity=21)
    first = block_hashes(system + [1] * 16, 16, "0", memo=memo)
    assert (memo.hits, memo.misses) == (0, 11)
    second = block_hashes(system + [2] * 16, 16, "0", memo=memo)
    assert (memo.hits, memo.misses) == (10, 12)  # only the question's block is new
    assert first[:10] == second[:10] and first[10] != second[10]
    assert second == block_hashes(system + [2] * 16, 16, "0")  # as without the memo
    salted = block_hashes(system, 16, "0", HashKeys(cache_salt="t"), memo)
    assert not set(salted) & set(first)  # another salt: other blocks, not remembered ones
    assert len(memo) == 21  # the least recently used went: the first question's block
    block_hashes(system + [2] * 16, 16, "0", memo=memo)
    assert memo.hits == 21
    block_hashes(system + [1] * 16, 16, "0", memo=memo)
    assert memo.hits == 31 and memo.misses == 23


def test_root_is_vllm_none_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    kv.init_none_hash(hashing.sha256_cbor)
    assert root_hash("42") == kv.NONE_HASH
    memo = HashMemo()  # remembered by seed, each its own
    assert memo.root("42") == kv.NONE_HASH == memo.root("42") != memo.root("7")


def test_event_hash_is_vllm_int_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv.envs, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", True, raising=False)
    h = block_hashes(list(range(32)), 16, "0")[1]
    assert event_hash(h) == kv.maybe_convert_block_hash(h)
    assert event_hash(BlockHash(bytes(24) + b"\x00\x00\x00\x00\x00\x00\x01\x02")) == 258


def test_salt_and_seed_change_every_hash() -> None:
    tokens = list(range(64))
    plain = block_hashes(tokens, 16, "0")
    salted = block_hashes(tokens, 16, "0", HashKeys(cache_salt="tenant:a"))
    reseeded = block_hashes(tokens, 16, "1")
    assert not set(plain) & set(salted)  # the salt in block 0 flows down the chain
    assert not set(plain) & set(reseeded)


def test_incremental_chain_equals_one_shot() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(0, 5000) for _ in range(1000)]
    chain = BlockChain(block_size=64, seed="0", keys=HashKeys(cache_salt="s"))
    completed: list[BlockHash] = []
    i = 0
    while i < len(tokens):
        step = rng.randrange(1, 150)
        completed += chain.extend(tokens[i : i + step])
        i += step
    assert completed == chain.hashes == block_hashes(tokens, 64, "0", HashKeys(cache_salt="s"))
    assert chain.num_tokens == 1000


def test_hex_round_trip_and_validation() -> None:
    h = block_hashes(list(range(16)), 16, "0")[0]
    assert from_hex(to_hex(h)) == h
    with pytest.raises(ValueError, match="32 bytes"):
        from_hex("abcd")
    with pytest.raises(ValueError, match="positive"):
        BlockChain(block_size=0, seed="0")
