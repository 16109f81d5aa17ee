"""An engine core's pin semantics in memory, and a clock the tests move (shared by the
span and retention tests)."""

from __future__ import annotations

from typing import Any

from engines.errors import EngineUnavailable
from manifest.hashing import BlockHash


class FakeCore:
    """The plugin's pin semantics, in memory."""

    def __init__(
        self, resident: list[BlockHash], capacity: int, num_blocks: int | None = None
    ) -> None:
        self.resident = {bytes(h) for h in resident}
        self.num_blocks = num_blocks  # the KV blocks cache_stats reports (None: it fails)
        self.pins: set[bytes] = set()
        self.holds: dict[bytes, set[str]] = {}  # who holds each pinned block (no expiry)
        self.capacity = capacity
        self.calls: list[str] = []
        self.touched: list[list[bytes]] = []  # each touch's resident blocks

    async def call_core(self, method: str, *args: Any) -> Any:
        self.calls.append(method)
        if method == "vcache_pin":
            out: dict[str, list[bytes]] = {
                "pinned": [],
                "already": [],
                "missing": [],
                "refused": [],
            }
            holder = args[2] if len(args) > 2 else ""
            for h in args[0]:
                if h in self.pins:
                    out["already"].append(h)
                elif h not in self.resident:
                    out["missing"].append(h)
                    continue
                elif len(self.pins) >= self.capacity:
                    out["refused"].append(h)
                    continue
                else:
                    self.pins.add(h)
                    out["pinned"].append(h)
                self.holds.setdefault(h, set()).add(holder)
            return out
        if method == "vcache_resident":
            return sorted(self.resident)
        if method == "vcache_unpin":
            holder = args[1] if len(args) > 1 else None
            done = []
            for h in args[0]:
                held = self.holds.get(h, set())
                held.discard(holder) if holder is not None else held.clear()
                if not held and h in self.pins:
                    self.pins.discard(h)
                    self.holds.pop(h, None)
                    done.append(h)
            return {"unpinned": done}
        if method == "vcache_touch":
            self.touched.append([bytes(h) for h in args[0] if h in self.resident])
            missing = [h for h in args[0] if h not in self.resident]
            return {"touched": len(self.touched[-1]), "missing": missing}
        if method == "vcache_sweep":
            return {"unpinned": []}
        if method == "vcache_cache_stats":
            if self.num_blocks is None:
                raise EngineUnavailable("the core does not answer")
            return {"num_blocks": self.num_blocks, "pinned_blocks": len(self.pins)}
        raise AssertionError(method)

    def generate(self, request: Any) -> Any:
        raise AssertionError("not used")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
