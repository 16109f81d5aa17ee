"""The prefix DAG: anchors, send order (send-one-then-fan), chains, concentration."""

from __future__ import annotations

import random

import pytest

from manifest.economics import recall_pays, zipf_coverage
from manifest.prefix_dag import PrefixDag, Unit


def unit(uid: str, *blocks: str, size: int = 10) -> Unit:
    return Unit(uid, tuple(blocks), tuple(size for _ in blocks))


def test_siblings_share_their_anchor_and_wait_for_its_first_unit() -> None:
    dag = PrefixDag(
        [
            unit("a1", "S", "A", "a1"),
            unit("b1", "S", "B", "b1"),
            unit("a2", "S", "A", "a2"),
            unit("b2", "S", "B", "b2"),
            unit("a3", "S", "A", "a3"),
        ]
    )
    steps = dag.order()
    # depth first: A's units together, then B's, each anchor's first unit leading
    assert [s.unit for s in steps] == ["a1", "a2", "a3", "b1", "b2"]
    after = {s.unit: (s.after, s.shared_tokens) for s in steps}
    assert after["a1"] == (None, 0)  # computes S and S+A
    assert after["a2"] == ("a1", 20) and after["a3"] == ("a1", 20)
    assert after["b1"] == ("a1", 10)  # reads S from a1, computes S+B
    assert after["b2"] == ("b1", 20)


def test_anchors_are_ranked_by_tokens_saved() -> None:
    units = [unit(f"a{i}", "S", "A", f"a{i}") for i in range(4)]
    units += [unit(f"b{i}", "S", "B", f"b{i}", size=10) for i in range(2)]
    dag = PrefixDag(units)
    anchors = dag.anchors()
    by_blocks = {a.blocks: a for a in anchors}
    assert set(by_blocks) == {("S",), ("S", "A"), ("S", "B")}
    assert by_blocks[("S",)].units == 6 and by_blocks[("S",)].own_tokens == 10
    assert by_blocks[("S", "A")].units == 4 and by_blocks[("S", "A")].tokens == 20
    # S: 10 tokens read by 5 more units; S+A: 10 more read by 3; S+B: 10 read by 1
    assert [a.blocks for a in anchors] == [("S",), ("S", "A"), ("S", "B")]
    assert anchors[0].value > anchors[1].value > anchors[2].value
    assert dag.anchors(top=1) == anchors[:1]


def test_a_unit_alone_waits_for_nothing_and_no_anchor_is_made_of_it() -> None:
    dag = PrefixDag([unit("x", "X", "x"), unit("y", "Y", "y")])
    assert [(s.unit, s.after) for s in dag.order()] == [("x", None), ("y", None)]
    assert dag.anchors() == []


def test_chains_are_parent_links_and_a_parent_goes_first() -> None:
    dag = PrefixDag(
        [
            unit("k2", "P", "k1", "k2"),
            unit("k1", "P", "k1"),
            unit("k3", "P", "k1", "k2", "k3"),
            unit("other", "P", "z"),
        ]
    )
    assert dag.parents() == {"k2": "k1", "k3": "k2"}
    order = [s.unit for s in dag.order()]
    assert order.index("k1") < order.index("k2") < order.index("k3")


def test_a_deep_chain_does_not_recurse() -> None:
    blocks = [f"b{i}" for i in range(1500)]
    units = [Unit(f"u{i}", tuple(blocks[: i + 1]), (1,) * (i + 1)) for i in range(1500)]
    dag = PrefixDag(units)
    parents = dag.parents()
    assert parents["u1499"] == "u1498" and "u0" not in parents
    assert [s.unit for s in dag.order()][:3] == ["u0", "u1", "u2"]


def test_every_unit_is_ordered_once_and_waits_only_for_an_earlier_unit() -> None:
    rng = random.Random(7)
    units = []
    for i in range(300):
        anchor = f"A{min(int(rng.paretovariate(1.2)), 20)}"
        units.append(unit(f"u{i}", "SYS", anchor, f"q{i}"))
    steps = PrefixDag(units).order()
    assert sorted(s.unit for s in steps) == sorted(u.id for u in units)
    seen: set[str] = set()
    for s in steps:
        assert s.after is None or s.after in seen
        seen.add(s.unit)
    assert sum(s.after is None for s in steps) == 1  # all share SYS


def test_concentration_is_the_zipf_skew_of_the_branches() -> None:
    units = []
    for rank in range(1, 51):
        for j in range(round(1000 * rank**-1.5)):
            units.append(unit(f"{rank}-{j}", f"A{rank}", f"q{rank}-{j}"))
    s = PrefixDag(units).concentration()
    assert s is not None and s == pytest.approx(1.5, abs=0.1)
    assert PrefixDag([unit("x", "X")]).concentration() is None


def test_duplicate_ids_and_ragged_units_are_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        PrefixDag([unit("x", "X"), unit("x", "Y")])
    with pytest.raises(ValueError, match="blocks"):
        Unit("x", ("a", "b"), (1,))


def test_the_recall_gate_refuses_the_300x_loss_and_passes_amortized_fan_out() -> None:
    # §11.0: a 30k-token prefix replayed for one 10-token unit at r = 0.1
    assert not recall_pays(30_000, 10, 1, 0.1)
    # break-even: k * 10 * 0.9 > 3000 from k = 334
    assert not recall_pays(30_000, 10, 333, 0.1)
    assert recall_pays(30_000, 10, 334, 0.1)
    assert recall_pays(1_000, 500, 1, 0.1)  # a big unit under a small prefix pays alone
    with pytest.raises(ValueError):
        recall_pays(1, 1, 1, 1.0)


def test_the_seven_anchor_coverage_law_holds_on_a_measured_dag() -> None:
    """§5.2: at s = 1.74 the top 7 of 1000 anchors carry about 85% of the units."""
    v, s, total = 1000, 1.74, 20_000
    weights = [r**-s for r in range(1, v + 1)]
    norm = sum(weights)
    units = []
    for rank, w in enumerate(weights, start=1):
        for j in range(max(1, round(total * w / norm))):
            units.append(unit(f"{rank}-{j}", f"A{rank}", f"q{rank}-{j}"))
    dag = PrefixDag(units)
    top7 = sum(a.units for a in dag.anchors(top=7))
    assert top7 / len(units) == pytest.approx(zipf_coverage(7, v, s), abs=0.03)
