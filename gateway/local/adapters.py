"""The LoRA adapters the local replicas serve, each as a model of its own.

An adapter is known by name (:class:`~engines.lora.LoraRef`: name and path) when it
is configured (``engine.lora.adapters``, loaded by every embedded engine at its
start), loaded at run time (the admin routes), learned from a replica that holds it
(a remote replica's ``/v1/models``), or found in the resolver directory
(``<resolver_dir>/<name>/adapter_config.json``, as vLLM's filesystem resolver finds
one).  Which replica holds which adapter is kept per engine: a restarted replica's
new engine is asked again (an embedded one holds its configured adapters again).

Routing (:meth:`Adapters.candidates`, the policy in
:mod:`gateway.local.adapter_placement`) sends a request to the replicas that hold
its adapter or are loading it, and to one that must load it only where the cache
hit it gives outweighs the load (measured per adapter: bytes, seconds); with none
holding it, to one that can load it (the adapter's name decides among equals).
The block hashes carry the adapter
(``("lora", name, path)``), so among them the one with its prefix warm wins as for
the base model.  A replica chosen that does not hold it loads it first
(:meth:`Adapters.ensure`): concurrent first requests for one adapter wait for the
one load.  A load onto a replica whose slots (vLLM's ``max_cpu_loras``) are full lets
its least recently used adapter go first, never one that is leased (spans under it
pinned there: a cache-API pin, :meth:`Adapters.lease`, or any pin on the first block
of one of its recent prompts, an agent session's lease across a tool call among
them): the engine's own LRU eviction would not ask.  A
load that fails is a 400 naming why (the engine's own message), and the replica
keeps serving.

The session log records the adapter a request ran under (name, path and the sha256
of its weights files, :func:`weights_digest`), so a replay can tell that the
weights changed since.  The digest is read when an adapter becomes known (again
after it was unloaded everywhere) and at every load an engine is sent (what the
engine then holds is what was read; an engine's own adapters when it is first
asked, off the event loop), never per request: :meth:`Adapters.find`
hands out the adapter with it, and :meth:`Adapters.digest` says what the gateway
read last.  A request recorded with weights that a load then found changed is not
sent (503 ``adapter_changed``; retried, it records the new ones).  An adapter whose
files are not on this host (a remote replica's) has none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from engines.base import Engine, GenerateRequest
from engines.errors import EngineError, EngineInputError
from engines.lora import AdapterEngine, LoraRef
from gateway.core.errors import InvalidRequest, NotFound, Unavailable, from_engine_error
from gateway.local.adapter_placement import LoadCost, Option, load_tokens, place
from gateway.local.replica_set import ReplicaSet
from gateway.local.replicas import Replica
from gateway.local.spans import image_spans
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
PREFILL_S_PER_TOKEN = 1e-3  # what routing weighs a load against (a CPU engine's order)
FIRST_BLOCKS = 64  # per adapter: the first blocks of its recent prompts kept (leases)


def weights_bytes(path: str | Path) -> int:
    """The bytes of an adapter's files (0: no such directory)."""
    root = Path(path)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


def weights_digest(path: str | Path) -> str | None:
    """The sha256 of an adapter's files: over each regular file under ``path`` in the
    order of its relative path, that path and the sha256 of its bytes; None when there
    is no such directory (an adapter on another host, or gone)."""
    root = Path(path)
    if not root.is_dir():
        return None
    out = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        out.update(f.relative_to(root).as_posix().encode() + b"\0" + h.digest())
    return out.hexdigest()


def _lora(engine: Engine) -> AdapterEngine | None:
    return engine if isinstance(engine, AdapterEngine) and engine.lora_enabled else None


class Adapters:
    def __init__(
        self,
        replicas: ReplicaSet,
        base: str,
        configured: Sequence[LoraRef] = (),
        resolver_dir: Path | None = None,
        enabled: bool = False,
        slots: int | None = None,
        prefill_s_per_token: float = PREFILL_S_PER_TOKEN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``base``: the served name of the base model (an adapter may not take it);
        ``configured``: the adapters every embedded engine loads at its start;
        ``enabled``: the local engines run with LoRA (else nothing is an adapter);
        ``slots``: the adapters an engine holds before loading one lets another go
        (vLLM's max_cpu_loras; None: not known); ``prefill_s_per_token``: what a
        load's seconds are worth in prompt tokens, for routing."""
        self._replicas = replicas
        self.base = base
        self.enabled = enabled
        self._resolver = resolver_dir
        self._slots = slots
        self._known: dict[str, LoraRef] = {a.name: a for a in configured}
        self._configured = dict(self._known)
        # per replica: the engine the residency was learned from, and what it holds
        self._held: dict[LocationId, tuple[Engine, dict[str, LoraRef]]] = {}
        self._loads: dict[tuple[LocationId, str], asyncio.Task[None]] = {}
        # the sha256 of each adapter's weights as last read (None: not readable here)
        self._digests: dict[LoraRef, str | None] = {}
        self._prefill_s = prefill_s_per_token
        self._clock = clock
        self.costs: dict[str, LoadCost] = {}  # each adapter's last load, measured
        # per replica and adapter name: its last use (a counter, for LRU), its leases
        # (owner -> until, on the clock)
        self._used: dict[tuple[LocationId, str], int] = {}
        self._uses = 0
        self._leases: dict[tuple[LocationId, str], dict[str, float]] = {}
        # per adapter name: the first blocks of its recent prompts (keyed by the adapter:
        # one pinned on a replica is a span under it held there, whoever pinned it)
        self._firsts: dict[str, dict[BlockHash, None]] = {}
        self.evictions = 0  # adapters let go to make room for a load
        self.loads = 0  # adapter loads sent to engines (the first requests' included)

    # ---------------------------------------------------------------- lookup

    def find(self, name: str) -> LoraRef | None:
        """The adapter served as ``name`` (None: no adapter is), with the digest of its
        weights: known, or found in the resolver directory (then known from now on)."""
        if not self.enabled or name == self.base:
            return None
        known = self._known.get(name)
        if known is None and self._resolver is not None and "/" not in name:
            where = self._resolver / name
            if not name.startswith(".") and (where / ADAPTER_CONFIG).is_file():
                known = self._known[name] = LoraRef(name, str(where))
        if known is None:
            return None
        if known not in self._digests:  # read once, when it becomes known
            self._digests[known] = weights_digest(known.path)
        return dataclasses.replace(known, sha256=self._digests[known])

    def digest(self, adapter: LoraRef) -> str | None:
        """The sha256 of ``adapter``'s weights as the gateway read them last (when it
        became known, or at its last load); None when it was never read or is not on
        this host."""
        return self._digests.get(adapter)

    def get(self, name: str, param: str = "model") -> LoraRef:
        """The adapter ``name``; a 404 naming it when there is none."""
        adapter = self.find(name)
        if adapter is None:
            raise NotFound(
                f"The adapter '{name}' does not exist", param=param, code="model_not_found"
            )
        return adapter

    def listed(self) -> list[LoraRef]:
        """Every adapter known now (configured, loaded, learned), by name."""
        return sorted(self._known.values(), key=lambda a: a.name)

    def where(self, adapter: LoraRef) -> set[LocationId]:
        """The replicas whose current engine holds ``adapter`` (its name at its path)."""
        out: set[LocationId] = set()
        for r in self._replicas.replicas:
            held = self._held.get(r.id)
            if held is not None and held[0] is r.engine and held[1].get(adapter.name) == adapter:
                out.add(r.id)
        return out

    def candidates(self, adapter: LoraRef, greq: GenerateRequest | None = None) -> set[LocationId]:
        """Where a request under ``adapter`` (``greq``: its prompt, for the cache hit
        each replica gives) may go: :func:`~gateway.local.adapter_placement.place` over
        the replicas, each holding it (or loading it now), able to load it (a free slot,
        or an unleased adapter to let go) or neither; empty when none qualifies (any
        replica then)."""
        holding = self.where(adapter)
        loading = {rid for rid, name in self._loads if name == adapter.name}
        cached: Mapping[LocationId, int] = {}
        kv = self._replicas.kv
        if greq is not None and kv is not None:
            hashes = kv.hashes(greq.prompt_token_ids, greq.cache_salt, adapter, image_spans(greq))
            cached = kv.predict(hashes, greq.num_prompt_tokens)
            if hashes:
                self._first_block(adapter.name, hashes[0])
        options = [
            Option(
                r.id,
                cached.get(r.id, 0),
                r.id in holding or r.id in loading,
                self._loadable(r),
                self._free(r),
            )
            for r in self._replicas.replicas
        ]
        prompt = greq.num_prompt_tokens if greq is not None else 0
        load = load_tokens(self.costs.get(adapter.name), self._prefill_s)
        return place(options, prompt, load, adapter.name)

    def _free(self, replica: Replica) -> bool:
        """Whether ``replica`` has a free adapter slot (with its slots not known, yes)."""
        held = self._current(replica)
        return self._slots is None or (held is not None and len(held) < self._slots)

    def _loadable(self, replica: Replica) -> bool:
        """Whether ``replica`` can load one more adapter: a free slot, or one it holds
        that is not leased (to let go); with its slots not known, yes."""
        held = self._current(replica)
        if self._slots is None:
            return True
        if held is None:
            return False
        return len(held) < self._slots or any(not self.leased(replica.id, n) for n in held)

    # --------------------------------------------------------------- leases

    def _first_block(self, name: str, h: BlockHash) -> None:
        firsts = self._firsts.setdefault(name, {})
        firsts.pop(h, None)
        firsts[h] = None  # the most recent last
        while len(firsts) > FIRST_BLOCKS:
            del firsts[next(iter(firsts))]

    def lease(self, replica: LocationId, name: str, owner: str, lease_s: float) -> None:
        """``owner`` holds spans under the adapter ``name`` on ``replica`` for
        ``lease_s``: the adapter is not let go there to make room until it ends (or
        :meth:`unlease`)."""
        self._leases.setdefault((replica, name), {})[owner] = self._clock() + lease_s

    def leased_on(self, name: str) -> list[str]:
        """The replicas where a live lease keeps the adapter ``name``."""
        return sorted(r.id for r in self._replicas.replicas if self.leased(r.id, name))

    def unlease(self, replica: LocationId, name: str, owner: str) -> None:
        held = self._leases.get((replica, name))
        if held is not None:
            held.pop(owner, None)
            if not held:
                del self._leases[(replica, name)]

    def leased(self, replica: LocationId, name: str) -> bool:
        """Whether spans under ``name`` are held on ``replica``: a live lease (expired
        ones go), or a pin there on the first block of one of its recent prompts (an
        agent session's KV leased across a tool call, a breakpoint's retention, a pin by
        raw block hashes: whoever pinned it)."""
        held = self._leases.get((replica, name))
        if held:
            now = self._clock()
            for owner in [o for o, until in held.items() if until <= now]:
                del held[owner]
            if held:
                return True
            del self._leases[(replica, name)]
        kv = self._replicas.kv
        firsts = self._firsts.get(name)
        return (
            kv is not None
            and firsts is not None
            and any(kv.index.is_pinned(replica, h) for h in firsts)
        )

    def residency(self) -> dict[str, list[str]]:
        """Adapter name -> the replicas known to hold it (what the admin route shows)."""
        out: dict[str, list[str]] = {a.name: sorted(self.where(a)) for a in self.listed()}
        return out

    # --------------------------------------------------------------- learn

    async def learn(self, replica: Replica) -> dict[str, LoraRef]:
        """What ``replica``'s engine holds now (asked of it: a remote replica's own
        list; an embedded one's loaded adapters); adapters it holds become known."""
        engine = _lora(replica.engine)
        held: dict[str, LoraRef] = {}
        if engine is not None and replica.engine.ready:
            try:
                held = {a.name: a for a in await engine.adapters()}
            except EngineError as exc:
                log.warning("replica %s: adapters not listed (%s)", replica.id, exc)
        self._held[replica.id] = (replica.engine, held)
        for a in held.values():
            self._known.setdefault(a.name, a)
            if a not in self._digests:  # read off the event loop, before a request needs it
                self._digests[a] = await asyncio.to_thread(weights_digest, a.path)
        return held

    async def learn_all(self) -> None:
        """Ask every serving replica what it holds."""
        for r in self._replicas.serving():
            await self.learn(r)

    async def learn_new(self) -> None:
        """Ask the serving replicas not asked yet (new, or restarted since) what they
        hold: a remote replica's adapters are served from the first request on.  Cheap
        once every replica was asked."""
        if not self.enabled:
            return
        for r in self._replicas.serving():
            if self._current(r) is None:
                await self.learn(r)

    def _current(self, replica: Replica) -> dict[str, LoraRef] | None:
        held = self._held.get(replica.id)
        return held[1] if held is not None and held[0] is replica.engine else None

    # ---------------------------------------------------------------- load

    async def ensure(self, replica: Replica, adapter: LoraRef) -> None:
        """``adapter`` loaded on ``replica`` before a request under it is sent there:
        nothing when it holds it; one load however many requests wait for it.  A 503
        ``adapter_changed`` when the weights were read again since the request recorded
        ``adapter.sha256`` and differ (a retry records them)."""
        held = self._current(replica)
        if held is None:
            held = await self.learn(replica)
        self._uses += 1
        self._used[(replica.id, adapter.name)] = self._uses
        if held.get(adapter.name) != adapter:
            key = (replica.id, adapter.name)
            task = self._loads.get(key)
            if task is None:
                task = asyncio.ensure_future(self._load(replica, adapter))
                self._loads[key] = task
                task.add_done_callback(lambda t: self._loaded(key, t))
            await asyncio.shield(task)
        now = self._digests.get(adapter)
        if adapter.sha256 is not None and now != adapter.sha256:
            raise Unavailable(  # the log would not say what the engine runs
                f"the LoRA adapter '{adapter.name}' was loaded again with other weights "
                f"(sha256 {now}) since this request was recorded (sha256 "
                f"{adapter.sha256}); retry",
                code="adapter_changed",
                retry_after_s=1,
            )

    def _loaded(self, key: tuple[LocationId, str], task: asyncio.Task[None]) -> None:
        """A load ended: the next first request loads again; its failure was raised to
        every request that waited for it (read here too, for one whose requests left)."""
        self._loads.pop(key, None)
        if not task.cancelled():
            task.exception()

    async def _load(self, replica: Replica, adapter: LoraRef) -> None:
        engine = _lora(replica.engine)
        if engine is None:
            raise InvalidRequest(
                f"replica {replica.id} does not serve LoRA adapters (engine.lora.enabled)",
                param="model",
                code="lora_disabled",
            )
        await self._make_room(replica, engine, adapter.name)
        self.loads += 1
        digest = await asyncio.to_thread(weights_digest, adapter.path)
        size = await asyncio.to_thread(weights_bytes, adapter.path)
        t0 = self._clock()
        try:
            await engine.load_adapter(adapter)
        except EngineInputError as exc:
            raise InvalidRequest(
                str(exc), param=exc.param or "model", code="adapter_load_failed"
            ) from exc
        except EngineError as exc:
            raise from_engine_error(exc) from exc
        log.info("replica %s: adapter %s loaded from %s", replica.id, adapter.name, adapter.path)
        self._digests[adapter] = digest  # what the engine read now
        self.costs[adapter.name] = LoadCost(size, self._clock() - t0)
        await self.learn(replica)
        self._known[adapter.name] = adapter

    async def _make_room(self, replica: Replica, engine: AdapterEngine, name: str) -> None:
        """With ``replica``'s slots full, let its least recently used adapter that is
        not leased go before ``name`` is loaded (the engine's own eviction would take
        the least recently used, leased or not); a 503 when every one is leased."""
        held = self._current(replica) or {}
        if self._slots is None or len(held) < self._slots or name in held:
            return
        free = [n for n in held if not self.leased(replica.id, n)]
        if not free:
            raise Unavailable(
                f"every adapter slot on replica {replica.id} holds a leased adapter "
                f"({', '.join(sorted(held))}): '{name}' cannot be loaded there until a "
                "lease ends",
                code="adapter_slots_leased",
                retry_after_s=5,
            )
        victim = min(free, key=lambda n: self._used.get((replica.id, n), 0))
        try:
            gone = await engine.unload_adapter(victim)
        except EngineError as exc:
            raise from_engine_error(exc) from exc
        if gone:
            self.evictions += 1
            log.info("replica %s: adapter %s let go to load %s", replica.id, victim, name)
        await self.learn(replica)

    def _targets(self, replica_id: str | None) -> list[Replica]:
        if replica_id is None:
            return list(self._replicas.serving())
        r = self._replicas.replica(replica_id)
        if r is None:
            raise NotFound(
                f"Unknown replica '{replica_id}'", param="replica", code="replica_not_found"
            )
        return [r]

    async def load(self, adapter: LoraRef, replica_id: str | None = None) -> list[str]:
        """Load ``adapter`` on one replica or every serving one (the admin route); the
        replicas it was loaded on.  A name served by the base model is a 400."""
        if not self.enabled:
            raise InvalidRequest(
                "the local engines run without LoRA (engine.lora.enabled)",
                param="lora_name",
                code="lora_disabled",
            )
        if adapter.name == self.base:
            raise InvalidRequest(
                f"'{adapter.name}' is the base model's name",
                param="lora_name",
                code="invalid_value",
            )
        targets = self._targets(replica_id)
        for r in targets:
            await self.ensure(r, adapter)
        self._known[adapter.name] = adapter
        return [r.id for r in targets]

    async def load_path(self, name: str, path: str, replica_id: str | None = None) -> list[str]:
        """:meth:`load` of the adapter ``name`` at ``path`` (the admin route's body)."""
        return await self.load(LoraRef(name, path), replica_id)

    async def unload(self, name: str, replica_id: str | None = None) -> list[str]:
        """Unload ``name`` from one replica or all (the admin route); the replicas it was
        unloaded from.  Requests running under it finish; the next one loads it again
        where it is routed while it stays known (configured, or in the resolver
        directory); one unloaded everywhere otherwise is forgotten."""
        adapter = self.get(name, param="lora_name")
        done: list[str] = []
        for r in self._targets(replica_id):
            engine = _lora(r.engine)
            if engine is None:
                continue
            try:
                gone = await engine.unload_adapter(name)
            except EngineError as exc:
                raise from_engine_error(exc) from exc
            if gone:
                done.append(r.id)
            await self.learn(r)
        if not done:
            raise NotFound(
                f"The adapter '{name}' is not loaded"
                + (f" on replica '{replica_id}'" if replica_id else ""),
                param="lora_name",
                code="adapter_not_loaded",
            )
        anywhere = any(adapter == h.get(name) for _, h in self._held.values())
        if not anywhere:  # read again when it is named next: it will be loaded again
            self._digests.pop(adapter, None)
        if not anywhere and replica_id is None and not self._kept(adapter):
            self._known.pop(name, None)
        return done

    def _kept(self, adapter: LoraRef) -> bool:
        """Whether ``adapter`` stays known unloaded: configured, or in the resolver
        directory."""
        if self._configured.get(adapter.name) == adapter:
            return True
        return self._resolver is not None and Path(adapter.path).parent == self._resolver


def adapter_refs(adapters: Mapping[str, str]) -> list[LoraRef]:
    return [LoraRef(name, path) for name, path in adapters.items()]
