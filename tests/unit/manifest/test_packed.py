"""The packed table against a dict: every operation, growth, the cuckoo path, key 0."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from manifest.hashing import block_hashes, event_hash
from manifest.packed import PackedTable, from_digests, norm

KEYS = st.integers(min_value=0, max_value=2**64 - 1)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "clear"]),
        st.lists(st.one_of(KEYS, st.integers(0, 40)), max_size=60, unique=True),
        st.integers(0, 2),
    ),
    max_size=40,
)


def _model_apply(model: dict[int, int], op: str, keys: list[int], bit: int) -> set[int]:
    changed = set()
    for k in keys:
        k = k or 2**64 - 1
        m = model.get(k, 0)
        if op == "add" and not m & bit:
            model[k] = m | bit
            changed.add(k)
        elif op == "remove" and m & bit:
            changed.add(k)
            if m & ~bit:
                model[k] = m & ~bit
            else:
                del model[k]
    if op == "clear":
        for k, m in list(model.items()):
            if m & bit:
                changed.add(k)
                if m & ~bit:
                    model[k] = m & ~bit
                else:
                    del model[k]
    return changed


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_the_table_behaves_like_a_dict(ops: list[tuple[str, list[int], int]]) -> None:
    t = PackedTable(buckets_log2=1)  # tiny: growth and kicks happen early
    model: dict[int, int] = {}
    for op, keys, b in ops:
        bit = np.uint64(1 << b)
        expected = _model_apply(model, op, keys, 1 << b)
        if op == "add":
            got = t.add(np.unique(norm(keys)), bit)
        elif op == "remove":
            got = t.remove(np.unique(norm(keys)), bit)
        else:
            got = t.clear_bit(bit)
        assert set(got.tolist()) == expected
        assert len(t) == len(model)
        assert dict(t.items()) == model
        probe = [*list(model)[:10], 12345, 0]
        want = [model.get(k or 2**64 - 1, 0) for k in probe]
        assert t.masks(norm(probe)).tolist() == want


def test_a_million_keys_fit_in_under_36_bytes_each() -> None:
    rng = np.random.default_rng(1)
    keys = np.unique(rng.integers(1, 2**63, size=1_000_000, dtype=np.uint64))
    t = PackedTable()
    for chunk in np.array_split(keys, 50):  # the way KV events arrive: batches
        t.add(chunk, np.uint64(1))
    assert len(t) == len(keys)
    assert 16 * t.capacity / len(t) < 36
    assert t.count_bit(np.uint64(1)) == len(keys)
    assert np.all(t.masks(keys[:5000]) == 1)


def test_keys_read_from_digests_are_the_event_hashes() -> None:
    hashes = block_hashes(list(range(64)), 16, "0")
    assert from_digests(hashes).tolist() == [event_hash(h) or 2**64 - 1 for h in hashes]
    assert from_digests([]).tolist() == []
