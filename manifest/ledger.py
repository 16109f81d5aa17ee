"""The savings ledger: credit only what telemetry confirmed and the render record verified.

Provider savings are token-equivalents, ``cached * (1 - r) - written * (w - 1)``
under the provider's price table, credited only up to the longest verified
marker prefix; the rest of a reported hit is kept as *unverified* and never
credited.  Local-engine reuse (tokens vLLM served from its prefix cache) is a
separate account, so nothing is counted twice: credited as vLLM reported it,
never as the gateway predicted it.  A prediction the gateway marked approximate
(``x-vcache-prediction``) that promised more than the engine reported keeps the
difference as *unconfirmed*, never credited; an exact prediction that missed is
counted as a miss.
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


@dataclass(frozen=True)
class LocalCredit:
    replica: str
    reported_tokens: int  # cached tokens vLLM reported
    credited_tokens: int  # never more than reported
    unconfirmed_tokens: int  # an approximate prediction's promise beyond the report


@dataclass
class _LocalAccount:
    reported: int = 0
    credited: int = 0
    unconfirmed: int = 0
    exact_missed: int = 0  # predictions said exact that the report contradicted


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
    local: dict[str, _LocalAccount] = field(default_factory=dict)

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

    def credit_local(
        self,
        replica: str,
        cached_tokens: int,
        predicted_tokens: int | None = None,
        exact: bool = True,
    ) -> LocalCredit:
        """Credit what vLLM reported it served from cache (``cached_tokens``), whatever was
        predicted: an approximate prediction's tokens beyond it are unconfirmed, an exact
        one that differs is a miss."""
        if cached_tokens < 0 or (predicted_tokens is not None and predicted_tokens < 0):
            raise ValueError("token counts are non-negative")
        over = 0
        acc = self.local.setdefault(replica, _LocalAccount())
        if predicted_tokens is not None:
            if not exact:
                over = max(predicted_tokens - cached_tokens, 0)
            elif predicted_tokens != cached_tokens:
                acc.exact_missed += 1
        acc.reported += cached_tokens
        acc.credited += cached_tokens
        acc.unconfirmed += over
        self.local_reused[replica] = self.local_reused.get(replica, 0) + cached_tokens
        return LocalCredit(replica, cached_tokens, cached_tokens, over)

    def provider_saved(self) -> float:
        return sum(a.saved for a in self.providers.values())

    def check_integrity(self) -> None:
        for target, a in self.providers.items():
            if not 0 <= a.credited <= a.confirmed:
                raise AssertionError(f"{target}: credited {a.credited} > confirmed {a.confirmed}")
            if a.credited + a.unverified != a.confirmed:
                raise AssertionError(f"{target}: credited + unverified != confirmed")
        for replica, acc in self.local.items():
            if not 0 <= acc.credited <= acc.reported:
                raise AssertionError(f"{replica}: credited {acc.credited} > reported")
            if self.local_reused.get(replica, 0) != acc.credited:
                raise AssertionError(f"{replica}: reused != credited")
