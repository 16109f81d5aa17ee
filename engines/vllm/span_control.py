"""A typed client of the engine-core plugin's span control (``engines/vllm/plugin.py``).

Any engine that runs core calls serves it: the embedded ``AsyncLLM``
(utility calls) or a remote replica (its control endpoint).  An engine whose
core takes a hold carried in its request (:attr:`SpanControl.in_request`: the
embedded engine, engines/vllm/core_holds.py) needs no core call for it; a remote
replica's holds are core calls.  This is the one
error boundary of those calls: an :class:`~engines.errors.EngineError` passes
as it is, anything else a core call raises (a dead core, a plugin's own
failure, a reply of the wrong shape) becomes
:class:`~engines.errors.EngineUnavailable`, so the gateway maps every failure
of span control once, to a 503 with Retry-After or a fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engines.errors import EngineError, EngineUnavailable


class CoreCaller(Protocol):
    async def call_core(self, method: str, *args: Any) -> Any: ...


@dataclass(frozen=True)
class PinReply:
    pinned: tuple[bytes, ...]  # pinned by this call
    already: tuple[bytes, ...]  # pinned before it
    missing: tuple[bytes, ...]  # not resident: nothing to pin
    refused: tuple[bytes, ...]  # over the pin budget


def _hashes(value: Any) -> tuple[bytes, ...]:
    return tuple(bytes(h) for h in value)


def _held(res: Any) -> tuple[int, str]:
    """A ``vcache_hold`` reply: (blocks held, why none were)."""
    try:
        return int(res["held"]), str(res["refused"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineUnavailable(f"engine core call vcache_hold answered {res!r}") from exc


class SpanControl:
    def __init__(self, engine: CoreCaller) -> None:
        self._engine = engine

    @property
    def in_request(self) -> bool:
        """Whether the engine's core takes a hold carried in its request
        (``GenerateRequest.hold``) instead of :meth:`hold`: the embedded engine's
        ``holds_in_request``; a remote replica's is not."""
        return getattr(self._engine, "holds_in_request", False) is True

    async def _call(self, method: str, *args: Any) -> Any:
        """A core call's reply, through this module's one error boundary: an
        :class:`EngineError` as it is, anything else as :class:`EngineUnavailable`."""
        try:
            return await self._engine.call_core(method, *args)
        except EngineError:
            raise
        except Exception as exc:
            raise EngineUnavailable(f"engine core call {method} failed: {exc}") from exc

    async def _reply(self, method: str, *args: Any) -> dict[str, Any]:
        res = await self._call(method, *args)
        if not isinstance(res, dict):
            raise EngineUnavailable(f"engine core call {method} answered {type(res).__name__}")
        return res

    async def pin(
        self,
        hashes: Sequence[bytes],
        max_share: float,
        holder: str = "",
        hold_s: float | None = None,
    ) -> PinReply:
        """Pin resident blocks, at most ``max_share`` of the pool pinned in all, held by
        ``holder`` for ``hold_s`` (None: until released); pinning again renews the hold."""
        res = await self._reply("vcache_pin", [bytes(h) for h in hashes], max_share, holder, hold_s)
        try:
            return PinReply(*(_hashes(res[k]) for k in ("pinned", "already", "missing", "refused")))
        except (KeyError, TypeError) as exc:
            raise EngineUnavailable(f"engine core call vcache_pin answered {res!r}") from exc

    async def unpin(self, hashes: Sequence[bytes], holder: str | None = None) -> tuple[bytes, ...]:
        """Drop ``holder``'s hold (every hold when None); the blocks released (nobody
        holds them any more)."""
        res = await self._reply("vcache_unpin", [bytes(h) for h in hashes], holder)
        return _hashes(res.get("unpinned", ()))

    async def hold(
        self, hold_id: str, hashes: Sequence[bytes], max_share: float, reserve: int, ttl_s: float
    ) -> tuple[int, str]:
        """Hold the leading resident blocks of ``hashes`` for ``hold_id`` until
        :meth:`release` or ``ttl_s``: (how many leading blocks are held, why none were:
        ``""`` when held or none resident, ``"budget"``, ``"reserve"``, ``"duplicate"``)."""
        res = await self._call(
            "vcache_hold", hold_id, [bytes(h) for h in hashes], max_share, reserve, ttl_s
        )
        return _held(res)

    async def release(self, hold_ids: Sequence[str]) -> int:
        """Let holds go; how many blocks nobody holds any more."""
        return int((await self._reply("vcache_release", list(hold_ids))).get("freed", 0))

    async def sweep(self) -> tuple[bytes, ...]:
        """Release the blocks whose holds have all run out; which."""
        return _hashes((await self._reply("vcache_sweep")).get("unpinned", ()))

    async def evict(self, hashes: Sequence[bytes]) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """Evict blocks no request or pin holds: (evicted, busy)."""
        res = await self._reply("vcache_evict", [bytes(h) for h in hashes])
        return _hashes(res.get("evicted", ())), _hashes(res.get("busy", ()))

    async def touch(self, hashes: Sequence[bytes]) -> tuple[int, tuple[bytes, ...]]:
        """Make resident blocks the last the engine evicts: (how many, the missing)."""
        res = await self._reply("vcache_touch", [bytes(h) for h in hashes])
        try:
            return int(res["touched"]), _hashes(res["missing"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineUnavailable(f"engine core call vcache_touch answered {res!r}") from exc

    async def resident(self) -> tuple[bytes, ...]:
        """Every block hash the engine's prefix cache holds now."""
        return _hashes(await self._call("vcache_resident"))

    async def barrier(self) -> int:
        """The sequence number of the last KV-event batch sent (every event before it is
        on the wire)."""
        return int(await self._call("vcache_events_barrier"))

    async def cache_stats(self) -> dict[str, Any]:
        return await self._reply("vcache_cache_stats")
