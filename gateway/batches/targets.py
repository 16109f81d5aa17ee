"""The hosted targets a batch's model resolves to, as the provider plan sees them.

:class:`BatchTargets` resolves a model the way the service does (an alias's targets, or
``provider/model``) and gives each hosted target's cache economics and its rate-limit
headroom as its last answer reported it (:class:`~gateway.batches.provider_plan.ProviderOption`);
the local model and unknown names give none.  :func:`option_of` makes one from a
capability profile (``vcache plan --batch-file --target``, no gateway).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from engines.providers.ratelimits import RateLimits
from engines.providers.specs import PROVIDERS
from gateway.batches.hit_share import HitShares
from gateway.batches.provider_client import SUPPORTED, Endpoint
from gateway.batches.provider_plan import (
    Choice,
    Headroom,
    ProviderOption,
    Sample,
    compare,
    kind_of,
    measure,
)
from gateway.core.errors import APIError
from gateway.core.provider_settings import ProviderConfig
from manifest.planner import CapabilityProfile, Regime
from manifest.prefix_dag import Step, Unit

LONG_WRITE_MULT = 2.0  # Anthropic's 1-hour TTL (shared/seeds/001 §5)


def headroom_of(limits: RateLimits | None) -> Headroom | None:
    if limits is None:
        return None
    return Headroom(
        float(limits.requests_remaining) if limits.requests_remaining is not None else None,
        float(limits.tokens_remaining) if limits.tokens_remaining is not None else None,
    )


def option_of(
    target: str, profile: CapabilityProfile, headroom: Headroom | None = None
) -> ProviderOption:
    explicit = profile.regime is Regime.EXPLICIT
    return ProviderOption(
        target,
        explicit,
        profile.read_mult,
        profile.write_mult,
        LONG_WRITE_MULT if explicit and len(profile.ttl_options_s) > 1 else profile.write_mult,
        profile.min_prefix_tokens,
        1 if explicit else profile.granularity,
        headroom,
    )


def profile_option(target: str, headroom: Headroom | None = None) -> ProviderOption:
    """``provider/model`` from its provider's documented profile (no gateway)."""
    provider, _, model = target.partition("/")
    spec = PROVIDERS.get(provider)
    if spec is None or not model:
        raise ValueError(f"{target!r} is not provider/model of a known provider")
    return option_of(target, spec.profile(model, 300), headroom)


class Reports(Protocol):
    @property
    def limits(self) -> RateLimits | None:
        """The headroom the provider's last answer reported."""
        ...


class HostedTarget(Protocol):
    """What the plan reads of a provider target (``gateway.providers.targets``)."""

    @property
    def name(self) -> str: ...

    @property
    def profile(self) -> CapabilityProfile: ...

    @property
    def client(self) -> Reports: ...


class BatchTargets:
    def __init__(
        self,
        resolve: Callable[[str], list[str]],
        target: Callable[[str], HostedTarget] | None,
        providers: Mapping[str, ProviderConfig] | None = None,
        hit_shares: HitShares | None = None,
    ) -> None:
        """``providers``: the configured providers, where their batch APIs live;
        ``hit_shares``: the in-batch hit shares measured so far (None: the prior)."""
        self._resolve = resolve
        self._target = target
        self._providers = dict(providers or {})
        self._hit_shares = hit_shares

    def endpoint(self, target: str) -> Endpoint | None:
        """Where ``provider/model``'s batch API lives (None: a provider without one here)."""
        provider = target.partition("/")[0]
        cfg = self._providers.get(provider)
        if cfg is None or provider not in SUPPORTED:
            return None
        key = cfg.resolved_key(provider)
        if key is None:
            return None
        headers = PROVIDERS[provider].adapter().auth_headers(key)
        return Endpoint(provider, cfg.resolved_base_url(provider), headers)

    def batch_api(self, model: str, units: Sequence[Unit], steps: Sequence[Step]) -> Choice | None:
        """The hosted target whose own batch API the provider plan chooses for a batch of
        ``model``, with the breakpoint TTL its items take: its first target, when that is
        hosted, has a batch API here and the plan finds it cheaper than online in DAG
        order (None: run online)."""
        options = self.options(model)
        try:
            first = self._resolve(model)[0]
        except (APIError, IndexError):
            return None
        if not options or options[0].target != first or self.endpoint(first) is None:
            return None
        plan = compare(options[0], units, steps)
        if plan["choice"] != "batch_api":
            return None
        return Choice(first, plan["batch_api"]["ttl"], kind_of(options[0]))

    def learn(self, target: str, kind: str, samples: Iterable[Sample]) -> tuple[float, int] | None:
        """Add a finished provider batch's measured hit share to ``target``'s (its
        answered items' planned shared tokens and size, and their usage); the measure
        (None: nothing kept, no hit shares here or not a target)."""
        if self._hit_shares is None or self._target is None:
            return None
        try:
            t = self._target(target)
        except (APIError, ValueError, KeyError):
            return None
        hits, reads = measure(option_of(t.name, t.profile), samples)
        self._hit_shares.learn(target, kind, hits, reads)
        return hits, reads

    def options(self, model: str) -> list[ProviderOption]:
        """The hosted targets of ``model``, in its alias's order (none: local only)."""
        if self._target is None:
            return []
        try:
            names = self._resolve(model)
        except APIError:
            return []
        out = []
        for name in names:
            if "/" not in name:
                continue  # the local model
            try:
                t = self._target(name)
            except (APIError, ValueError, KeyError):
                continue
            o = option_of(t.name, t.profile, headroom_of(t.client.limits))
            if self._hit_shares is not None:
                o = dataclasses.replace(o, hit_share=self._hit_shares.of(t.name))
            out.append(o)
        return out
