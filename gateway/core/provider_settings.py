"""The hosted providers' settings: each provider's client, cache rules and prices, the
control loop over their anchors, and how an alias orders its targets by cost."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, SecretStr

from engines.providers.specs import PROVIDERS


class ControlSettings(BaseModel):
    """The control loop over hosted-provider anchors (design note §5.4, §5.5; M3, M5).

    ``mode``: ``off`` (warms only when asked through the cache API), ``govern`` (per
    anchor: ride, heartbeat, lazy or evict, the TTL tier that costs less, warms inside
    the rate-limit headroom, send-one-then-fan), ``heartbeat_all`` (every anchor kept
    warm with heartbeats, no budget: the baseline a load test compares against)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["off", "govern", "heartbeat_all"] = "off"  # see above
    tick_s: float = Field(5.0, gt=0)  # real seconds between decisions
    horizon_s: float = Field(3600.0, gt=0)  # arrivals older than this are forgotten
    latency_value: float = Field(1.0, ge=0)  # L: a warm first token, per anchor token
    heartbeat_at: float = Field(0.8, gt=0, lt=1)  # share of the TTL before a heartbeat
    reserve: float = Field(0.25, ge=0, lt=1)  # headroom share kept for real traffic
    max_warms_per_tick: int = Field(8, ge=0)  # warms and heartbeats sent per tick, at most
    fan_wait_s: float = Field(10.0, ge=0)  # send-one-then-fan: longest hold of a sibling
    max_anchors: int = Field(4096, ge=1)  # anchors tracked at most (new ones past it are not)
    # an agent session's predicted pause, at most (its tip's heartbeats stop there)
    session_max_gap_s: float = Field(3600.0, gt=0)
    # The provider clock runs this many times faster than real time: only for load
    # tests against an emulator started with the same --time-scale.
    clock_scale: float = Field(1.0, gt=0)


class PriceConfig(BaseModel):
    """Cache prices as multiples of the model's uncached input price."""

    model_config = ConfigDict(extra="forbid")

    read_mult: float = Field(ge=0, le=1)  # a cache read, times the uncached input price
    write_mult: float = Field(ge=0)  # a cache write, times the uncached input price


class ProviderConfig(BaseModel):
    """A hosted provider.  The key comes from ``api_key`` or the environment variable
    ``api_key_env`` (default ``ANTHROPIC_API_KEY``, ``OPENAI_API_KEY``, ...); it is
    never logged."""

    model_config = ConfigDict(extra="forbid")

    base_url: str | None = None  # None: the provider's public API
    api_key: SecretStr | None = None  # None: from api_key_env
    api_key_env: str | None = None  # None: the provider's usual variable (ANTHROPIC_API_KEY...)
    timeout_s: float = Field(60, gt=0)  # longest wait for the next bytes (connect: <= 10 s)
    max_retries: int = Field(2, ge=0, le=10)  # retries of a failed request before fallback
    backoff_base_s: float = Field(0.5, ge=0)  # first retry's delay, doubling, with jitter
    backoff_cap_s: float = Field(8, ge=0)  # the longest backoff delay
    # a retry-after longer than this is not waited for: the error goes to fallback at once
    max_retry_after_s: float = Field(30, ge=0)
    cache_ttl_s: Literal[300, 3600] = 300  # Anthropic breakpoints: 5m or 1h
    # OpenAI: "24h" asks for extended prompt caching (prefixes kept up to a day); set
    # belief_ttl_s to match what the models in use honor (calibrate to find it)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    belief_ttl_s: float = Field(300, gt=0)  # implicit caches: mean survival of a prefix
    cached_content_ttl_s: int = Field(3600, ge=60)  # Gemini explicit caches
    min_prefix_tokens: dict[str, int] = Field(default_factory=dict)  # model prefix → tokens
    prices: dict[str, PriceConfig] = Field(default_factory=dict)  # model prefix → prices
    # model prefix → uncached input price per million tokens, in the unit
    # routing.local_input_price uses (USD, say); a model without one is priced 1.0
    input_prices: dict[str, NonNegativeFloat] = Field(default_factory=dict)

    def resolved_base_url(self, provider: str) -> str:
        return self.base_url or PROVIDERS[provider].base_url

    def resolved_key(self, provider: str) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(self.api_key_env or PROVIDERS[provider].key_env) or None


class RoutingSettings(BaseModel):
    """How an alias with several targets orders them.  ``cost``: by the prompt's expected
    price on each (its uncached tokens at the target's input price, its cached tokens at
    the read price: the exact index on the local replicas, the warmth belief on a
    provider), the alias order breaking ties and ordering the fallbacks; ``order``: the
    alias order alone."""

    model_config = ConfigDict(extra="forbid")

    by: Literal["cost", "order"] = "cost"  # see above
    # the local replicas' price per million uncached prompt tokens, in the providers'
    # input_prices unit: 0 (owned GPUs) keeps them first wherever they serve
    local_input_price: float = Field(0.0, ge=0)
    # a later target goes first only when it costs less than (1 - margin) of an earlier one
    margin: float = Field(0.1, ge=0, lt=1)
