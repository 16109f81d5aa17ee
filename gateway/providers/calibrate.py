"""Probe a provider target and fit its cache rules (``vcache calibrate TARGET``).

The probes are the real thing: each is a fresh anchor (a system prompt that
opens with a new nonce, so nothing cached before can answer it) sent through
the provider's adapter and client, with a breakpoint on it where the regime
is explicit.  What the provider reports (cached, written) is all the fitting
uses (``manifest.calibration``):

- minimum: the smallest anchor that caches (explicit: the first send writes;
  implicit: a second send reads), searched by size;
- granularity: cached counts at a few sizes past the minimum;
- TTL: a fresh anchor written, ``wait(d)``, sent again; searched over ``d``
  (per tier: Anthropic's 5m and 1h breakpoints).

``wait`` is the clock: ``asyncio.sleep`` against a real provider (a TTL probe
then takes as long as the TTL, hours for a 1h tier); against the emulator,
its admin clock is advanced instead.  A fitted profile is stored under
``<data_dir>/calibration/`` and used by the provider path in place of the
documented constants.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx

from engines.providers.base import CacheDirectives, ChatCall, ProviderUsage, Turn
from gateway.core.config import Settings
from gateway.core.metrics import Metrics
from gateway.providers.path import ProviderPath
from gateway.providers.targets import ProviderTarget, calibration_path, target_profile
from manifest.calibration import CalibratedProfile, Search, fit_granularity
from manifest.planner import Regime

Wait = Callable[[float], Awaitable[None]]
_FILLER = "the anchor of a calibration probe keeps these words in the same order. "


def emulator_clock(url: str) -> Wait:
    """Advance the emulator's clock instead of sleeping."""

    async def wait(seconds: float) -> None:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(f"{url.rstrip('/')}/admin/clock/advance", json={"seconds": seconds})
            r.raise_for_status()

    return wait


class Calibrator:
    def __init__(self, target: ProviderTarget, wait: Wait, max_chars: int = 200_000) -> None:
        self.t = target
        self.wait = wait
        self.max_chars = max_chars
        self.probes = 0
        self.explicit = target.profile.regime is Regime.EXPLICIT

    def _call(self, chars: int) -> ChatCall:
        head = f"calibration probe {uuid.uuid4().hex}\n"
        body = (_FILLER * (chars // len(_FILLER) + 1))[: max(0, chars - len(head))]
        return ChatCall(
            model=self.t.model, system=head + body, turns=(Turn("user", "ok"),), max_tokens=1
        )

    async def _send(self, call: ChatCall, long_tier: bool) -> ProviderUsage:
        cache = CacheDirectives()
        if self.explicit:
            cache = CacheDirectives(breakpoints=("system",), ttl_s=3600 if long_tier else 300)
        rendered = self.t.client.adapter.render(call, cache)
        self.probes += 1
        return (await self.t.client.complete(rendered)).usage

    async def _caches(self, chars: int) -> int:
        """Tokens the provider caches of a fresh anchor of ``chars`` (0: below the minimum)."""
        call = self._call(chars)
        first = await self._send(call, False)
        if self.explicit:
            return first.cache_write_tokens
        return (await self._send(call, False)).cached_tokens

    async def _alive_after(self, chars: int, delay: float, long_tier: bool) -> bool:
        call = self._call(chars)
        await self._send(call, long_tier)
        await self.wait(delay)
        return (await self._send(call, long_tier)).cached_tokens > 0

    async def minimum(self) -> tuple[int, int]:
        """(the smallest caching anchor in chars, the tokens cached there)."""
        search = Search(start=2048, cap=self.max_chars)
        cached: dict[int, int] = {}
        while (chars := search.next()) is not None:
            n = await self._caches(int(chars))
            cached[int(chars)] = n
            search.record(chars, n > 0)
        if search.ok is None:
            raise RuntimeError(f"{self.t.name}: nothing cached up to {self.max_chars} chars")
        return int(search.ok), cached[int(search.ok)]

    async def granularity(self, chars: int, minimum: int) -> int:
        if self.explicit:
            return 1  # a breakpoint caches exactly what it marks
        seen = [await self._caches(int(chars * f)) for f in (1.13, 1.29, 1.47, 1.71, 1.93)]
        return fit_granularity(seen, minimum) or self.t.profile.granularity

    async def ttl(self, chars: int, long_tier: bool, start: float) -> float:
        search = Search(start=start, cap=172_800, integer=False, precision=0.04)
        while (delay := search.next()) is not None:
            search.record(delay, not await self._alive_after(chars, delay, long_tier))
        if search.estimate is None:
            raise RuntimeError(f"{self.t.name}: the cache outlived every probe (48 h)")
        return search.estimate

    async def run(self, long_tier: bool | None = None) -> CalibratedProfile:
        chars, minimum = await self.minimum()
        step = await self.granularity(chars, minimum)
        anchor = int(chars * 1.5)
        short = await self.ttl(anchor, False, 60.0)
        probe_long = self.explicit if long_tier is None else long_tier
        longer = await self.ttl(anchor, True, short * 2) if probe_long else None
        notes = ("read/write prices are not in the telemetry: they stay the configured ones",)
        return CalibratedProfile(
            target=self.t.name,
            min_prefix_tokens=minimum,
            granularity=step,
            ttl_s=short,
            ttl_long_s=longer,
            writes_billed=self.explicit,
            probes=self.probes,
            fitted_at=time.time(),
            notes=notes,
        )


def main(settings: Settings, target: str, emulator: str | None) -> int:
    """``vcache calibrate TARGET``: fit, print, store under the data dir."""
    path = ProviderPath(settings, Metrics())
    known = path.target(target)
    # probe and report against the documented rules, not an earlier fit
    documented = target_profile(known.spec, known.model, known.config)
    t = dataclasses.replace(known, profile=documented, calibrated=None)
    wait = emulator_clock(emulator) if emulator else asyncio.sleep
    if emulator is None:
        print(f"{target}: probing; TTL probes wait out each TTL (hours for a 1h tier)")

    async def run() -> CalibratedProfile:
        try:
            return await Calibrator(t, wait).run()
        finally:
            await path.close()

    cal = asyncio.run(run())
    rows = [
        ("minimum prefix (tokens)", documented.min_prefix_tokens, cal.min_prefix_tokens),
        ("granularity (tokens)", documented.granularity, cal.granularity),
        ("TTL (s)", t.ttl_s, round(cal.ttl_s, 1)),
        ("long-tier TTL (s)", "-", "-" if cal.ttl_long_s is None else round(cal.ttl_long_s, 1)),
        ("writes billed", documented.regime.value == "explicit", cal.writes_billed),
    ]
    print(f"{'rule':<26}{'documented':>14}{'fitted':>14}")
    for name, before, after in rows:
        print(f"{name:<26}{before!s:>14}{after!s:>14}")
    out = calibration_path(settings.data_dir, target)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cal.to_json())
    print(f"{cal.probes} probes; wrote {out} (the provider path uses it from the next start)")
    return 0
