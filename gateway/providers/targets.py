"""Provider targets: ``provider/model`` resolved to its client, cache rules and config.

One client per provider, one :class:`ProviderTarget` per model, both made on
first use.  A target's cache rules are the provider's documented profile
with this deployment's overrides and, once ``vcache calibrate`` has fitted
them, the calibrated ones (read from the data directory).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.providers.client import ProviderClient
from engines.providers.retry import RetryPolicy
from engines.providers.specs import PROVIDERS, ProviderSpec
from engines.providers.transport import Transport
from gateway.core.config import ProviderConfig, Settings
from gateway.core.errors import NotFound, Unavailable
from manifest.calibration import CalibratedProfile
from manifest.calibration import apply as apply_calibration
from manifest.ledger import PriceTable
from manifest.planner import CapabilityProfile, Regime

log = logging.getLogger(__name__)


def _by_prefix(table: dict[str, Any], model: str) -> Any:
    keys = sorted((k for k in table if model.startswith(k)), key=len, reverse=True)
    return table[keys[0]] if keys else None


def target_profile(spec: ProviderSpec, model: str, cfg: ProviderConfig) -> CapabilityProfile:
    """The provider's documented rules, with this deployment's overrides."""
    profile = spec.profile(model, cfg.cache_ttl_s)
    minimum = _by_prefix(cfg.min_prefix_tokens, model)
    if minimum is not None:
        profile = dataclasses.replace(profile, min_prefix_tokens=int(minimum))
    price = _by_prefix(cfg.prices, model)
    if price is not None:
        profile = dataclasses.replace(
            profile, read_mult=price.read_mult, write_mult=price.write_mult
        )
    return profile


def calibration_path(data_dir: Path, target: str) -> Path:
    """Where a target's fitted cache rules live (``vcache calibrate`` writes them)."""
    return data_dir / "calibration" / (target.replace("/", "__") + ".json")


@dataclass(frozen=True)
class ProviderTarget:
    name: str  # "provider/model"
    spec: ProviderSpec
    model: str
    client: ProviderClient
    profile: CapabilityProfile
    config: ProviderConfig
    calibrated: CalibratedProfile | None = None  # fitted by `vcache calibrate`

    @property
    def prices(self) -> PriceTable:
        return PriceTable(self.profile.read_mult, self.profile.write_mult)

    @property
    def input_price(self) -> float:
        """The uncached input price per million tokens this deployment set (1.0 unset)."""
        price = _by_prefix(self.config.input_prices, self.model)
        return 1.0 if price is None else float(price)

    @property
    def long_ttl_s(self) -> float:
        """The long tier's TTL (Anthropic 1h), fitted once calibrated."""
        cal = self.calibrated
        if cal is not None and cal.ttl_long_s:
            return cal.ttl_long_s
        opts = self.profile.ttl_options_s
        return float(opts[1]) if len(opts) >= 2 else self.ttl_s

    @property
    def ttl_s(self) -> float:
        """How long a written prefix lives: the fitted TTL of the configured tier once
        calibrated, else the documented one (explicit) or the configured belief."""
        long_tier = self.config.cache_ttl_s > 300
        cal = self.calibrated
        if cal is not None:
            return cal.ttl_long_s if long_tier and cal.ttl_long_s else cal.ttl_s
        if self.profile.regime is Regime.EXPLICIT:
            return float(self.config.cache_ttl_s)
        return self.config.belief_ttl_s


class ProviderTargets:
    """The configured providers' targets, made on first use (clients shared per provider)."""

    def __init__(
        self,
        settings: Settings,
        client_factory: Callable[..., ProviderClient] = ProviderClient,
        transport: Transport | None = None,
    ) -> None:
        self._settings = settings
        self._factory = client_factory
        self._transport = transport  # None: each client its own aiohttp session
        self._clients: dict[str, ProviderClient] = {}
        self._targets: dict[str, ProviderTarget] = {}

    def known(self) -> dict[str, ProviderTarget]:
        """The targets made so far."""
        return dict(self._targets)

    def target(self, name: str) -> ProviderTarget:
        """``provider/model`` for a configured provider."""
        if name in self._targets:
            return self._targets[name]
        provider, _, model = name.partition("/")
        cfg = self._settings.providers.get(provider)
        if cfg is None or not model:
            raise NotFound(
                f"The model '{name}' does not exist", param="model", code="model_not_found"
            )
        spec = PROVIDERS[provider]
        client = self._clients.get(provider)
        if client is None:
            key = cfg.resolved_key(provider)
            if key is None:
                raise Unavailable(
                    f"No API key is configured for provider '{provider}'",
                    code="provider_not_configured",
                )
            retry = RetryPolicy(
                cfg.max_retries, cfg.backoff_base_s, cfg.backoff_cap_s, cfg.max_retry_after_s
            )
            given = {} if self._transport is None else {"transport": self._transport}
            client = self._factory(
                spec.adapter(), cfg.resolved_base_url(provider), key, retry, cfg.timeout_s, **given
            )
            self._clients[provider] = client
        profile = target_profile(spec, model, cfg)
        cal = self._calibration(name)
        if cal is not None:
            profile = apply_calibration(profile, cal)
        t = ProviderTarget(name, spec, model, client, profile, cfg, cal)
        self._targets[name] = t
        return t

    def _calibration(self, name: str) -> CalibratedProfile | None:
        path = calibration_path(self._settings.data_dir, name)
        if not path.exists():
            return None
        try:
            cal = CalibratedProfile.from_json(path.read_text())
        except (OSError, ValueError, TypeError) as exc:
            log.warning("%s: ignoring the calibration at %s (%s)", name, path, exc)
            return None
        log.info("%s: using the calibrated cache rules from %s", name, path)
        return cal

    async def close(self) -> None:
        for c in self._clients.values():
            await c.aclose()
