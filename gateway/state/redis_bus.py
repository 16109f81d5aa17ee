"""The state bus on Redis: one stream of facts, one key per role.

Facts go to the stream ``<prefix>facts`` (``XADD``, capped near
``max_facts`` entries); every gateway reads it from where it left off
(``XREAD BLOCK``), skipping its own.  A gateway that starts reads the stream
from its beginning first, so it believes what the others learnt before it
came.  A role is the key ``<prefix>role:<name>`` holding the holder's
instance id with a TTL: taken with ``SET NX PX``, renewed (only by its
holder, a compare-and-set script) every third of the TTL; a holder that stops
renewing loses it when the TTL runs out.  A claim is ``<prefix>claim:<name>``,
set once with ``SET NX PX`` and left to expire.

Redis unreachable: publishes queue (the oldest dropped past ``max_queue``:
soft state, the next fact of the same kind supersedes it), the reader and the
role keeper retry every second, :attr:`failing_since` says since when, and a
role is not held while its lease cannot be renewed.  Back again, the gateway
republishes its snapshot, so a Redis restarted empty is rebuilt from the
gateways' memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import Any

from gateway.state.bus import Fact, Handler, Snapshot

log = logging.getLogger(__name__)

CLAIM_TIMEOUT_S = 0.5  # a claim is on a request's path: a slow store is not waited for

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""


class RedisBus:
    def __init__(
        self,
        url: str,
        origin: str,
        prefix: str = "vcache:",
        role_ttl_s: float = 10.0,
        max_facts: int = 100_000,
        max_queue: int = 10_000,
    ) -> None:
        import redis.asyncio as aioredis

        self.origin = origin
        self._redis = aioredis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        self._stream = f"{prefix}facts"
        self._role_prefix = f"{prefix}role:"
        self._claim_prefix = f"{prefix}claim:"
        self._role_ttl_s = role_ttl_s
        self._max_facts = max_facts
        self._queue: deque[tuple[str, dict[str, Any], float]] = deque(maxlen=max_queue)
        self._wake = asyncio.Event()
        self._handlers: dict[str, list[Handler]] = {}
        self._snapshots: list[Snapshot] = []
        self._roles: dict[str, float] = {}  # role → monotonic time its lease is good until
        self._wanted: set[str] = set()
        self._failing: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_id = "0"
        self._closing = False
        self.applied = 0
        self.sent = 0

    # ------------------------------------------------------------------ the API

    def publish(self, kind: str, body: dict[str, Any]) -> None:
        self._queue.append((kind, body, time.time()))
        self._wake.set()

    def on(self, kind: str, handler: Handler) -> None:
        self._handlers.setdefault(kind, []).append(handler)

    def snapshot(self, source: Snapshot) -> None:
        self._snapshots.append(source)

    def holds(self, role: str) -> bool:
        self._wanted.add(role)
        return self._roles.get(role, 0.0) > time.monotonic()

    async def claim(self, name: str, ttl_s: float) -> bool:
        """``SET NX PX`` on ``<prefix>claim:<name>``; a store that does not answer within
        :data:`CLAIM_TIMEOUT_S` leaves this gateway to act alone (True)."""
        key, ms = f"{self._claim_prefix}{name}", max(1, int(ttl_s * 1000))
        try:
            async with asyncio.timeout(CLAIM_TIMEOUT_S):
                return bool(await self._redis.set(key, self.origin, nx=True, px=ms))
        except Exception as exc:
            log.debug("state bus: claim %s not made (%s); acting alone", name, exc)
            return True

    @property
    def failing_since(self) -> float | None:
        return self._failing

    async def start(self) -> None:
        """Read what the others published before this gateway came, then keep up."""
        with contextlib.suppress(Exception):  # unreachable: the reader retries
            async with asyncio.timeout(10):
                await self._read(block_ms=None)
        self._tasks = [
            asyncio.create_task(self._forever(self._write_once), name="state-bus-writer"),
            asyncio.create_task(self._forever(self._read_once), name="state-bus-reader"),
            asyncio.create_task(self._forever(self._keep_roles), name="state-bus-roles"),
        ]

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._queue:
            with contextlib.suppress(Exception):  # a last flush, if the store is there
                async with asyncio.timeout(2):
                    await self._write_once()
        for role in [r for r in self._roles if self._roles[r] > time.monotonic()]:
            with contextlib.suppress(Exception):  # let another gateway take it at once
                key = self._role_prefix + role
                if (await self._redis.get(key)) == self.origin.encode():
                    await self._redis.delete(key)
        await self._redis.aclose()

    # ---------------------------------------------------------------- the tasks

    async def _forever(self, step: Any) -> None:
        while not self._closing:
            try:
                await step()
                if self._failing is not None:
                    log.info("state bus: Redis is back; republishing this gateway's state")
                    self._failing = None
                    self._republish()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._failing is None:
                    log.warning("state bus: Redis unreachable (%s); serving from memory", exc)
                    self._failing = time.monotonic()
                self._roles.clear()  # a lease that cannot be renewed is not held
                await asyncio.sleep(1.0)

    async def _write_once(self) -> None:
        if not self._queue:
            self._wake.clear()
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
            # that races the event, and close() would wait on this task forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._wake.wait()
            return
        batch, self._queue = self._queue, deque(maxlen=self._queue.maxlen)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for kind, body, at in batch:
                    data = json.dumps({"k": kind, "o": self.origin, "t": at, "b": body})
                    pipe.xadd(self._stream, {"f": data}, maxlen=self._max_facts, approximate=True)
                await pipe.execute()
        except BaseException:  # not sent: back in front of what came meanwhile (the
            self._queue = deque([*batch, *self._queue], maxlen=batch.maxlen)  # oldest drop)
            raise
        self.sent += len(batch)

    async def _read_once(self) -> None:
        await self._read(block_ms=1000)

    async def _read(self, block_ms: int | None) -> None:
        """Apply the facts after the last one read (all of them when ``block_ms`` is
        None: the catch-up at start)."""
        while True:
            got: Any = await self._redis.xread(
                {self._stream: self._last_id}, count=1000, block=block_ms
            )
            if not got:
                return
            for _, entries in got:
                for fid, fields in entries:
                    self._last_id = fid.decode() if isinstance(fid, bytes) else str(fid)
                    self._apply(fields)
            if block_ms is not None:
                return

    def _apply(self, fields: dict[Any, Any]) -> None:
        try:
            f = json.loads(fields[b"f"])
            fact = Fact(str(f["k"]), str(f["o"]), float(f["t"]), dict(f["b"]))
        except (TypeError, ValueError, KeyError) as exc:
            log.warning("state bus: a malformed fact skipped (%s)", exc)
            return
        if fact.origin == self.origin:
            return
        for handler in self._handlers.get(fact.kind, ()):
            try:
                handler(fact)
            except Exception:  # one bad fact never stops the reader
                log.exception("state bus: applying a %s fact failed", fact.kind)
        self.applied += 1

    async def _keep_roles(self) -> None:
        ttl_ms = int(self._role_ttl_s * 1000)
        for role in list(self._wanted):
            start = time.monotonic()
            got = await self._redis.eval(_RENEW, 1, self._role_prefix + role, self.origin, ttl_ms)
            if got:
                self._roles[role] = start + self._role_ttl_s
            else:
                self._roles.pop(role, None)
        await asyncio.sleep(self._role_ttl_s / 3)

    def _republish(self) -> None:
        for source in self._snapshots:
            try:
                for kind, body in source():
                    self.publish(kind, body)
            except Exception:
                log.exception("state bus: a snapshot failed")
