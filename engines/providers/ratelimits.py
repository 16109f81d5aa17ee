"""Rate-limit headroom as providers report it on every response.

Anthropic sends ``anthropic-ratelimit-requests-{limit,remaining}`` and
``anthropic-ratelimit-input-tokens-{limit,remaining}`` (or ``-tokens-``);
OpenAI and DeepSeek's OpenAI-compatible API send
``x-ratelimit-{limit,remaining}-{requests,tokens}``.  Gemini sends none: its
limits show only as 429 ``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

_NAMES = {
    "requests_limit": ("anthropic-ratelimit-requests-limit", "x-ratelimit-limit-requests"),
    "requests_remaining": (
        "anthropic-ratelimit-requests-remaining",
        "x-ratelimit-remaining-requests",
    ),
    "tokens_limit": (
        "anthropic-ratelimit-input-tokens-limit",
        "anthropic-ratelimit-tokens-limit",
        "x-ratelimit-limit-tokens",
    ),
    "tokens_remaining": (
        "anthropic-ratelimit-input-tokens-remaining",
        "anthropic-ratelimit-tokens-remaining",
        "x-ratelimit-remaining-tokens",
    ),
}


@dataclass(frozen=True)
class RateLimits:
    requests_limit: int | None = None
    requests_remaining: int | None = None
    tokens_limit: int | None = None
    tokens_remaining: int | None = None

    def share_left(self) -> float:
        """The smaller of the request and token headroom, as a share of the limit (1.0:
        nothing known)."""
        shares = [
            rem / lim
            for rem, lim in (
                (self.requests_remaining, self.requests_limit),
                (self.tokens_remaining, self.tokens_limit),
            )
            if rem is not None and lim
        ]
        return min(shares, default=1.0)


def parse_ratelimits(headers: Mapping[str, str]) -> RateLimits | None:
    """The headroom a response reports, or None when it reports none."""
    found: dict[str, int] = {}
    for field, names in _NAMES.items():
        for name in names:
            raw = headers.get(name)
            if raw is not None:
                try:
                    found[field] = int(float(raw))
                except ValueError:
                    continue
                break
    return RateLimits(**found) if found else None
