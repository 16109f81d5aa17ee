"""The savings ledger: credit only what telemetry confirmed and the render record verified.

Provider savings are token-equivalents, ``cached * (1 - r) - written * (w - 1)``
under the provider's price table, credited only up to the longest verified
marker prefix; the rest of a reported hit is kept as *unverified* and never
credited.  Local-engine reuse (tokens vLLM served from its prefix cache) is a
separate account, so nothing is counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from manifest.records import Verified


@dataclass(frozen=True)
class PriceTable:
    read_mult: float
    write_mult: float

    def __post_init__(self) -> None:
        if not 0 <= self.read_mult <= 1 or self.write_mult < 0:
            raise ValueError("read multiplier in [0, 1], write multiplier >= 0")


@dataclass(frozen=True)
class Credit:
    target: str
    confirmed_tokens: int
    credited_tokens: int
    unverified_tokens: int
    written_tokens: int
    saved: float  # token-equivalents


@dataclass
class _Account:
    confirmed: int = 0
    credited: int = 0
    unverified: int = 0
    written: int = 0
    saved: float = 0.0


@dataclass
class SavingsLedger:
    providers: dict[str, _Account] = field(default_factory=dict)
    local_reused: dict[str, int] = field(default_factory=dict)

    def credit_provider(
        self,
        target: str,
        prices: PriceTable,
        cached_tokens: int,
        written_tokens: int,
        verified: Verified,
    ) -> Credit:
        if cached_tokens < 0 or written_tokens < 0:
            raise ValueError("token counts are non-negative")
        credited = min(cached_tokens, verified.creditable_tokens)
        saved = credited * (1 - prices.read_mult) - written_tokens * (prices.write_mult - 1)
        acc = self.providers.setdefault(target, _Account())
        acc.confirmed += cached_tokens
        acc.credited += credited
        acc.unverified += cached_tokens - credited
        acc.written += written_tokens
        acc.saved += saved
        return Credit(
            target, cached_tokens, credited, cached_tokens - credited, written_tokens, saved
        )

    def credit_local(self, replica: str, cached_tokens: int) -> None:
        if cached_tokens < 0:
            raise ValueError("token counts are non-negative")
        self.local_reused[replica] = self.local_reused.get(replica, 0) + cached_tokens

    def provider_saved(self) -> float:
        return sum(a.saved for a in self.providers.values())

    def check_integrity(self) -> None:
        for target, a in self.providers.items():
            if not 0 <= a.credited <= a.confirmed:
                raise AssertionError(f"{target}: credited {a.credited} > confirmed {a.confirmed}")
            if a.credited + a.unverified != a.confirmed:
                raise AssertionError(f"{target}: credited + unverified != confirmed")
