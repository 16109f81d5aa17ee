"""What an operator can set on the emulator that clients are not told: cache rules that
differ from the documented ones, rate limits (RPM/TPM, with each provider's headers
and 429s), and the bill (tokens by price class, per provider).

- :class:`RuleOverride`: the minimum cacheable prefix, the TTL (and the long TTL:
  Anthropic's ``1h``, OpenAI's ``24h`` retention) and the cache step, per
  provider.  A calibrator must find them from usage telemetry alone.
- :class:`RateLimit`: requests and input tokens per minute of emulator time,
  a sliding window.  A request over either is refused with 429 before it
  reaches the cache, counted, and never billed.
- :class:`Bill`: uncached input, cache reads, writes at the short and the long
  TTL, output, requests and 429s: what a load test prices per arm.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RuleOverride:
    min_prefix: int | None = None
    ttl_s: float | None = None  # Anthropic 5m, OpenAI in_memory, DeepSeek, Gemini implicit
    ttl_long_s: float | None = None  # Anthropic 1h, OpenAI 24h
    granularity: int | None = None  # OpenAI / DeepSeek cache step


@dataclass
class RateLimit:
    rpm: int
    tpm: int
    window: deque[tuple[float, int]] = field(default_factory=deque)

    def _trim(self, now: float) -> None:
        while self.window and self.window[0][0] <= now - 60.0:
            self.window.popleft()

    def remaining(self, now: float) -> tuple[int, int]:
        self._trim(now)
        used = sum(t for _, t in self.window)
        return max(0, self.rpm - len(self.window)), max(0, self.tpm - used)

    def admit(self, now: float, tokens: int) -> float | None:
        """Take the request, or return the seconds (emulator time) until it would fit."""
        requests, left = self.remaining(now)
        if requests >= 1 and left >= tokens:
            self.window.append((now, tokens))
            return None
        oldest = self.window[0][0] if self.window else now
        return max(0.001, oldest + 60.0 - now)


@dataclass
class Bill:
    requests: int = 0
    rejected_429: int = 0
    uncached: int = 0
    read: int = 0
    write: int = 0  # at the short TTL (Anthropic 5m)
    write_long: int = 0  # at the long TTL (Anthropic 1h)
    output: int = 0

    def add(self, uncached: int, read: int, write: int, write_long: int, output: int) -> None:
        self.requests += 1
        self.uncached += uncached
        self.read += read
        self.write += write
        self.write_long += write_long
        self.output += output

    def view(self) -> dict[str, Any]:
        return asdict(self)


def limit_headers(provider: str, limit: RateLimit | None, now: float) -> dict[str, str]:
    """The rate-limit headers each provider sends (Gemini sends none)."""
    if limit is None or provider == "gemini":
        return {}
    requests, tokens = limit.remaining(now)
    if provider == "anthropic":
        return {
            "anthropic-ratelimit-requests-limit": str(limit.rpm),
            "anthropic-ratelimit-requests-remaining": str(requests),
            "anthropic-ratelimit-input-tokens-limit": str(limit.tpm),
            "anthropic-ratelimit-input-tokens-remaining": str(tokens),
        }
    return {
        "x-ratelimit-limit-requests": str(limit.rpm),
        "x-ratelimit-remaining-requests": str(requests),
        "x-ratelimit-limit-tokens": str(limit.tpm),
        "x-ratelimit-remaining-tokens": str(tokens),
    }
