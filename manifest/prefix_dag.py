"""A batch's prefix DAG (shared/seeds/001, §2, §5.2 and §8): the recall plan of a set of
work units known up front.

Each unit is a rendered prompt cut into cacheable blocks (a local replica's KV block
hashes, or a provider prompt's segment digests), each block with the tokens it holds.
:class:`PrefixDag` keeps them as a radix trie: a node is a run of blocks that every
unit under it shares, so a node with ``units`` ≥ 2 is an anchor, the prefix its units
read from cache once one of them has computed it.

- :meth:`PrefixDag.anchors` ranks anchors by what keeping them pays: the tokens of their
  own run (``size``) read by every unit but the first (``units - 1``, the frequency),
  per token of the units' own (the reuse density); the head is the cache working set.
- :meth:`PrefixDag.order` is the send order: depth first over the trie, so each
  anchor's units run together while it is warm, each unit with the unit it waits for
  (``after``): the first unit under the deepest anchor it shares, which computes that
  anchor (send-one-then-fan, §8).  A unit that shares nothing waits for nothing.
- :meth:`PrefixDag.concentration` is the measured Zipf skew ``s`` of anchor popularity
  (§5.2: ``s`` ≈ 1.74 puts 85% of the traffic under the top 7 of 10³ anchors).
- :meth:`PrefixDag.parents` are the chains: a unit whose whole prompt another unit's
  prompt extends (the second needs the first's answer in its prompt, §8's recall case).

Pure: the same units give the same DAG, order and ranking.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from manifest.economics import zipf_fit


@dataclass(frozen=True)
class Unit:
    """One work unit's prompt as cacheable blocks: ``blocks[i]`` holds ``tokens[i]``."""

    id: str
    blocks: tuple[int | str, ...]
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.blocks) != len(self.tokens):
            raise ValueError(f"unit {self.id}: {len(self.blocks)} blocks, {len(self.tokens)} sizes")

    @property
    def size(self) -> int:
        return sum(self.tokens)


@dataclass
class _Node:
    run: tuple[int | str, ...]  # the blocks from the parent node to this one
    run_tokens: int
    depth_tokens: int  # tokens from the root through this node
    children: dict[int | str, _Node] = field(default_factory=dict)
    ends: list[str] = field(default_factory=list)  # units whose prompt ends here
    units: int = 0  # units through (or ending at) this node


@dataclass(frozen=True)
class Anchor:
    """A prefix shared by ``units`` units: ``blocks`` from the root, ``tokens`` in all,
    ``own_tokens`` in its run below its parent anchor."""

    blocks: tuple[int | str, ...]
    tokens: int
    own_tokens: int
    units: int
    value: float  # own_tokens * (units - 1) / mean unit size: the ranking


@dataclass(frozen=True)
class Step:
    """A unit in send order, and the unit whose prefill it waits for (None: none)."""

    unit: str
    after: str | None
    shared_tokens: int  # tokens of the prefix it reads from ``after``'s prefill


class PrefixDag:
    def __init__(self, units: Sequence[Unit]) -> None:
        seen: set[str] = set()
        for u in units:
            if u.id in seen:
                raise ValueError(f"unit {u.id!r} appears twice")
            seen.add(u.id)
        self._units = {u.id: u for u in units}
        self._root = _Node((), 0, 0)
        for u in units:
            self._insert(u)

    def _insert(self, u: Unit) -> None:
        node, i = self._root, 0
        node.units += 1
        while i < len(u.blocks):
            child = node.children.get(u.blocks[i])
            if child is None:
                run = u.blocks[i:]
                size = sum(u.tokens[i:])
                node.children[u.blocks[i]] = leaf = _Node(run, size, node.depth_tokens + size)
                leaf.units, node = 1, leaf
                i = len(u.blocks)
                break
            common = _common(child.run, u.blocks, i)
            if common < len(child.run):
                child = self._split(node, child, common, u.tokens[i : i + common])
            child.units += 1
            node, i = child, i + common
        node.ends.append(u.id)

    @staticmethod
    def _split(parent: _Node, child: _Node, at: int, head_tokens: Sequence[int]) -> _Node:
        """Cut ``child``'s run after ``at`` blocks: a new node for the shared head."""
        size = sum(head_tokens)
        head = _Node(child.run[:at], size, parent.depth_tokens + size)
        head.units = child.units
        parent.children[child.run[0]] = head
        child.run, child.run_tokens = child.run[at:], child.run_tokens - size
        head.children[child.run[0]] = child
        return head

    def _walk(self) -> Iterator[tuple[_Node, tuple[int | str, ...], int]]:
        """Every node below the root, depth first in block order, with its blocks from
        the root and the tokens of the nearest anchor above it (0: none)."""
        stack: list[tuple[_Node, tuple[int | str, ...], int]] = [
            (c, c.run, 0) for c in reversed(list(self._root.children.values()))
        ]
        while stack:
            node, blocks, above = stack.pop()
            yield node, blocks, above
            mine = node.depth_tokens if node.units >= 2 else above
            stack.extend((c, blocks + c.run, mine) for c in reversed(list(node.children.values())))

    def anchors(self, top: int | None = None) -> list[Anchor]:
        """Prefixes shared by two units or more, the most valuable first."""
        mean = sum(u.size for u in self._units.values()) / max(1, len(self._units))
        out = [
            Anchor(
                blocks,
                node.depth_tokens,
                node.depth_tokens - above,
                node.units,
                (node.depth_tokens - above) * (node.units - 1) / max(mean, 1.0),
            )
            for node, blocks, above in self._walk()
            if node.units >= 2 and node.depth_tokens > above
        ]
        out.sort(key=lambda a: (-a.value, -a.units, a.blocks))
        return out if top is None else out[:top]

    def _events(self) -> Iterator[tuple[bool, _Node]]:
        """Depth first over the trie, children in insertion order: (True, node) on the
        way down, (False, node) once its subtree is done.  Iterative: a chain of units
        each extending the last is as deep as it is long."""
        stack: list[tuple[bool, _Node]] = [
            (True, c) for c in reversed(list(self._root.children.values()))
        ]
        while stack:
            down, node = stack.pop()
            yield down, node
            if down:
                stack.append((False, node))
                stack.extend((True, c) for c in reversed(list(node.children.values())))

    def order(self) -> list[Step]:
        """Every unit once, in send order (see the module): a unit whose prompt ends at
        a node goes before the units that extend it."""
        steps: list[Step] = []
        anchors: list[list[int | str | None]] = []  # on the path: [depth tokens, lead]
        for down, node in self._events():
            if not down:
                if node.units >= 2:
                    anchors.pop()
                continue
            if node.units >= 2:
                anchors.append([node.depth_tokens, None])
            for uid in node.ends:
                after, shared = None, 0
                for depth, lead in reversed(anchors):
                    if lead is not None:
                        after, shared = str(lead), int(depth or 0)
                        break
                for entry in anchors:
                    if entry[1] is None:
                        entry[1] = uid  # it computes this anchor's prefix
                steps.append(Step(uid, after, shared))
        return steps

    def concentration(self) -> float | None:
        """Zipf ``s`` of the top-level anchors' popularity (units under each root
        branch); None with fewer than two branches."""
        return zipf_fit([c.units for c in self._root.children.values()])

    def parents(self) -> dict[str, str]:
        """Unit → the unit whose whole prompt its prompt extends (the longest such)."""
        out: dict[str, str] = {}
        nearest: list[str | None] = [None]  # on the path: the deepest unit ending above
        for down, node in self._events():
            if not down:
                nearest.pop()
                continue
            for uid in node.ends:
                if nearest[-1] is not None:
                    out[uid] = str(nearest[-1])
            nearest.append(node.ends[0] if node.ends else nearest[-1])
        return out


def _common(run: Sequence[int | str], blocks: Sequence[int | str], start: int) -> int:
    """How many of ``run``'s blocks ``blocks`` repeats from ``start`` on."""
    n = min(len(run), len(blocks) - start)
    i = 0
    while i < n and run[i] == blocks[start + i]:
        i += 1
    return i
