"""Per-key limits: requests and tokens per minute, and requests at once.

Each API key may carry limits (``api_keys[].limits`` in the config).  A
request is admitted when the key has fewer than ``max_concurrent`` requests
in flight, fewer than ``requests_per_minute`` admitted in the last minute,
and fewer than ``tokens_per_minute`` tokens (prompt + completion, counted when
each answer ends) used in the last minute; otherwise it is a 429 with
``Retry-After`` (when the window frees what it needs) and the
``x-ratelimit-*`` headers OpenAI sends (the Messages routes rename them to
Anthropic's ``anthropic-ratelimit-*``).  Windows slide: a minute is the last
60 seconds, not a calendar minute.  The clock is injected.

Active-active gateways share the per-minute windows: each publishes what it
admitted and what each answer used (``usage`` facts on the state bus) and adds
the others' to its own windows, so a key's requests and tokens per minute hold
across gateways, within the bus's delay (milliseconds: a burst that reaches two
gateways at once may pass a limit by what arrives meanwhile).  ``max_concurrent``
stays per gateway: a gateway that died would hold the others' count forever.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.core.config import KeyLimits
from gateway.core.errors import RateLimited
from gateway.core.facts import Publish, no_one
from gateway.core.types import Principal

WINDOW_S = 60.0


@dataclass
class _Window:
    """What one key used in the last minute: (time, amount) entries, oldest first."""

    entries: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def prune(self, now: float) -> None:
        while self.entries and self.entries[0][0] <= now - WINDOW_S:
            self.total -= self.entries.popleft()[1]

    def add(self, now: float, n: int) -> None:
        if n > 0:
            self.entries.append((now, n))
            self.total += n

    def frees_in(self, now: float, need: int, limit: int) -> float:
        """Seconds until the window holds at most ``limit - need``."""
        over = self.total + need - limit
        for t, n in self.entries:
            over -= n
            if over <= 0:
                return max(t + WINDOW_S - now, 0.0)
        return WINDOW_S


@dataclass
class _Usage:
    requests: _Window = field(default_factory=_Window)
    tokens: _Window = field(default_factory=_Window)
    inflight: int = 0


def _reset(seconds: float) -> str:
    return f"{max(math.ceil(seconds), 0)}s"


class Grant:
    """An admitted request: :meth:`done` counts its tokens and frees its slot (once)."""

    def __init__(self, limiter: RateLimits, key: tuple[str, str], limits: KeyLimits) -> None:
        self._limiter, self._key, self._limits = limiter, key, limits
        self._open = True

    def done(self, tokens: int) -> None:
        if self._open:
            self._open = False
            self._limiter.finish(self._key, tokens)

    def headers(self) -> dict[str, str]:
        return self._limiter.headers(self._key, self._limits)


class RateLimits:
    def __init__(
        self, clock: Callable[[], float] = time.monotonic, publish: Publish = no_one
    ) -> None:
        self._clock = clock
        self._usage: dict[tuple[str, str], _Usage] = {}
        self.publish = publish

    def learn(self, body: dict[str, Any], elapsed: float) -> None:
        """Another gateway's admission or answer of a key, ``elapsed`` seconds ago."""
        tenant, name = body["key"]
        u = self._usage.setdefault((str(tenant), str(name)), _Usage())
        when = self._clock() - elapsed
        u.requests.add(when, int(body.get("requests", 0)))
        u.tokens.add(when, int(body.get("tokens", 0)))

    def admit(self, who: Principal) -> Grant | None:
        """Admit one request of ``who`` or raise 429; None when its key has no limits."""
        lim = who.limits
        if lim is None or lim.empty():
            return None
        key = (who.tenant, who.key_name)
        now = self._clock()
        u = self._usage.setdefault(key, _Usage())
        u.requests.prune(now)
        u.tokens.prune(now)
        why, wait = None, 0.0
        if lim.max_concurrent is not None and u.inflight >= lim.max_concurrent:
            why, wait = f"{lim.max_concurrent} concurrent requests", 1.0
        elif lim.requests_per_minute is not None and u.requests.total >= lim.requests_per_minute:
            why = f"{lim.requests_per_minute} requests per minute"
            wait = u.requests.frees_in(now, 1, lim.requests_per_minute)
        elif lim.tokens_per_minute is not None and u.tokens.total >= lim.tokens_per_minute:
            why = f"{lim.tokens_per_minute} tokens per minute"
            wait = u.tokens.frees_in(now, 1, lim.tokens_per_minute)
        if why is not None:
            raise RateLimited(
                f"Rate limit reached for key '{who.key_name or who.tenant}': {why}. "
                f"Retry in {math.ceil(wait)} s",
                code="rate_limit_exceeded",
                retry_after_s=max(wait, 1.0),
                headers=self.headers(key, lim),
            )
        u.requests.add(now, 1)
        u.inflight += 1
        if lim.requests_per_minute is not None:
            self.publish("usage", {"key": list(key), "requests": 1})
        return Grant(self, key, lim)

    def finish(self, key: tuple[str, str], tokens: int) -> None:
        u = self._usage[key]
        u.inflight -= 1
        u.tokens.add(self._clock(), tokens)
        if tokens > 0:
            self.publish("usage", {"key": list(key), "tokens": tokens})

    def headers(self, key: tuple[str, str], lim: KeyLimits) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the key's request and token limits."""
        now = self._clock()
        u = self._usage.get(key) or _Usage()
        out: dict[str, str] = {}
        for kind, limit, w in (
            ("requests", lim.requests_per_minute, u.requests),
            ("tokens", lim.tokens_per_minute, u.tokens),
        ):
            if limit is None:
                continue
            w.prune(now)
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(limit - w.total, 0))
            reset = w.entries[0][0] + WINDOW_S - now if w.entries else 0.0
            out[f"x-ratelimit-reset-{kind}"] = _reset(reset)
        return out


def anthropic_headers(headers: dict[str, str], now_epoch: float | None = None) -> dict[str, str]:
    """OpenAI's rate-limit headers renamed as Anthropic sends them (resets as RFC 3339
    times); other headers pass unchanged."""
    now = time.time() if now_epoch is None else now_epoch
    out: dict[str, str] = {}
    for name, value in headers.items():
        if not name.startswith("x-ratelimit-"):
            out[name] = value
            continue
        what, _, kind = name.removeprefix("x-ratelimit-").partition("-")
        if what == "reset":
            at = now + float(value.rstrip("s"))
            value = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(at)))
        out[f"anthropic-ratelimit-{kind}-{what}"] = value
    return out
