"""One planner over both regimes: where the cache cuts, what it will serve, what it costs.

A target is described by a :class:`CapabilityProfile` (data, never a class to
branch on).  The planner sees a prompt as a :class:`PromptLayout` — segment
boundaries with cumulative token counts — and a :class:`TargetState` (what is
resident or believed warm there), and returns a :class:`Plan`:

- **local exact** (vLLM): the cached prefix is known from the index, in whole
  blocks, never the prompt's last token; no breakpoints.
- **explicit** (Anthropic, Gemini's cached contents): up to ``max_breakpoints``
  cache markers on segment boundaries at or past the minimum cacheable prefix,
  stable region first, then the conversation tip, then evenly spread.
- **implicit** (OpenAI, DeepSeek): no markers; the provider caches a
  byte-stable prefix in ``granularity`` steps once it passes the minimum.

Cost is in token-equivalents of uncached input: read tokens cost ``read_mult``,
tokens written to the cache ``write_mult``, the rest 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from manifest.canonical import SegmentKind


class Regime(StrEnum):
    LOCAL_EXACT = "local_exact"
    EXPLICIT = "explicit"
    IMPLICIT = "implicit"


class WarmPrimitive(StrEnum):
    NONE = "none"  # the first real request warms (implicit providers)
    PREFILL = "prefill"  # local engine: prefill with one discarded token
    MAX_TOKENS_0 = "max_tokens_0"  # Anthropic
    CACHED_CONTENT = "cached_content"  # Gemini cachedContents


@dataclass(frozen=True)
class CapabilityProfile:
    target: str
    regime: Regime
    min_prefix_tokens: int
    granularity: int  # block size (local) or cache step (providers)
    max_breakpoints: int
    ttl_options_s: tuple[int, ...]
    warm: WarmPrimitive
    read_mult: float = 0.1
    write_mult: float = 1.0

    def __post_init__(self) -> None:
        if self.granularity <= 0 or self.min_prefix_tokens < 0 or self.max_breakpoints < 0:
            raise ValueError("invalid capability profile")
        if self.regime is not Regime.EXPLICIT and self.max_breakpoints:
            raise ValueError("only explicit regimes take breakpoints")


def local_vllm_profile(target: str, block_size: int) -> CapabilityProfile:
    return CapabilityProfile(
        target, Regime.LOCAL_EXACT, block_size, block_size, 0, (), WarmPrimitive.PREFILL, 0.0, 1.0
    )


ANTHROPIC_MIN_PREFIX = {
    "claude-opus-4": 4096,
    "claude-haiku-4-5": 4096,
    "claude-3-haiku": 2048,
    "default": 1024,
}
GEMINI_MIN_PREFIX = {"gemini-2.5-pro": 4096, "gemini-3": 4096, "default": 2048}  # 3.x: all 4096


def _min_prefix(table: dict[str, int], model: str) -> int:
    return next((v for k, v in table.items() if model.startswith(k)), table["default"])


def anthropic_profile(model: str, ttl_s: int = 300) -> CapabilityProfile:
    write = 1.25 if ttl_s <= 300 else 2.0
    minimum = _min_prefix(ANTHROPIC_MIN_PREFIX, model)
    return CapabilityProfile(
        f"anthropic:{model}",
        Regime.EXPLICIT,
        minimum,
        1,
        4,
        (300, 3600),
        WarmPrimitive.MAX_TOKENS_0,
        0.1,
        write,
    )


def openai_profile(model: str) -> CapabilityProfile:
    return CapabilityProfile(
        f"openai:{model}", Regime.IMPLICIT, 1024, 128, 0, (), WarmPrimitive.NONE, 0.5, 1.0
    )


def deepseek_profile(model: str) -> CapabilityProfile:
    return CapabilityProfile(
        f"deepseek:{model}", Regime.IMPLICIT, 64, 64, 0, (), WarmPrimitive.NONE, 0.1, 1.0
    )


def gemini_profile(model: str) -> CapabilityProfile:
    """Implicit caching from the model's minimum; explicit ``cachedContents`` are a warm
    primitive the gateway uses once an anchor's reuse passes the break-even."""
    return CapabilityProfile(
        f"gemini:{model}",
        Regime.IMPLICIT,
        _min_prefix(GEMINI_MIN_PREFIX, model),
        1,
        0,
        (),
        WarmPrimitive.CACHED_CONTENT,
        0.25,
        1.0,
    )


@dataclass(frozen=True)
class Boundary:
    """The end of one segment: ``tokens`` is the prefix length through it."""

    key: str
    kind: SegmentKind
    tokens: int


@dataclass(frozen=True)
class PromptLayout:
    boundaries: tuple[Boundary, ...]

    def __post_init__(self) -> None:
        last = 0
        for b in self.boundaries:
            if b.tokens < last:
                raise ValueError("boundaries must be cumulative and non-decreasing")
            last = b.tokens

    @property
    def total_tokens(self) -> int:
        return self.boundaries[-1].tokens if self.boundaries else 0

    def stable_end(self) -> int:
        """Index of the last boundary of the leading stable region, or -1."""
        end = -1
        for i, b in enumerate(self.boundaries):
            if b.kind not in (SegmentKind.STABLE, SegmentKind.TOOL_SCHEMA):
                break
            end = i
        return end


@dataclass(frozen=True)
class TargetState:
    """What the target holds for this prompt's prefix, in tokens."""

    resident_tokens: int = 0  # local exact: index.match * block size
    believed_warm_tokens: int = 0  # providers: longest prefix believed warm
    warm_probability: float = 0.0


@dataclass(frozen=True)
class Plan:
    target: str
    regime: Regime
    anchors: tuple[int, ...]  # boundary indices that are cacheable units
    breakpoints: tuple[int, ...]  # boundary indices to mark (explicit only)
    predicted_cached_tokens: int
    predicted_written_tokens: int
    cost: float  # token-equivalents

    def __post_init__(self) -> None:
        if list(self.breakpoints) != sorted(set(self.breakpoints)):
            raise ValueError("breakpoints must be sorted and unique")


def _anchors(layout: PromptLayout, profile: CapabilityProfile) -> list[int]:
    return [
        i
        for i, b in enumerate(layout.boundaries)
        if b.tokens >= max(profile.min_prefix_tokens, 1) and b.kind is not SegmentKind.VOLATILE
    ]


def _breakpoints(
    layout: PromptLayout, anchors: Sequence[int], limit: int, warm_tokens: int
) -> tuple[int, ...]:
    """Stable region end, then the tip (written for the next turn), then the
    boundary of what is believed warm (read now), then evenly spread anchors."""
    if not anchors or limit == 0:
        return ()
    chosen: list[int] = []
    warm = [a for a in anchors if 0 < layout.boundaries[a].tokens <= warm_tokens]
    for pick in (layout.stable_end(), anchors[-1], warm[-1] if warm else -1):
        if pick in anchors and pick not in chosen and len(chosen) < limit:
            chosen.append(pick)
    rest = [a for a in anchors if a not in chosen]
    room = limit - len(chosen)
    if room > 0 and rest:
        step = len(rest) / room
        chosen += [rest[min(len(rest) - 1, int(step * (k + 1)) - 1)] for k in range(room)]
    return tuple(sorted(set(chosen)))


def plan(layout: PromptLayout, profile: CapabilityProfile, state: TargetState) -> Plan:
    total = layout.total_tokens
    anchors = _anchors(layout, profile)
    g = profile.granularity
    breakpoints: tuple[int, ...] = ()
    if profile.regime is Regime.LOCAL_EXACT:
        cached = min(state.resident_tokens, max(total - 1, 0)) // g * g
        written = (max(total - 1, 0) // g * g) - cached
    elif profile.regime is Regime.EXPLICIT:
        warm = state.believed_warm_tokens if state.warm_probability >= 0.5 else 0
        breakpoints = _breakpoints(layout, anchors, profile.max_breakpoints, warm)
        marks = [layout.boundaries[i].tokens for i in breakpoints]
        cached = max((t for t in marks if t <= warm), default=0)
        written = max(marks, default=0) - cached
    else:
        warm = state.believed_warm_tokens if state.warm_probability >= 0.5 else 0
        stable_prefix = min(warm, total)
        cached = stable_prefix // g * g if stable_prefix >= profile.min_prefix_tokens else 0
        written = 0  # implicit caches are written for free by the request itself
    uncached = total - cached
    cost = cached * profile.read_mult + written * (profile.write_mult - 1) + uncached
    return Plan(
        target=profile.target,
        regime=profile.regime,
        anchors=tuple(anchors),
        breakpoints=breakpoints,
        predicted_cached_tokens=cached,
        predicted_written_tokens=written,
        cost=cost,
    )


def client_breakpoints(
    layout: PromptLayout, profile: CapabilityProfile, keys: Sequence[str]
) -> tuple[int, ...] | None:
    """The boundary indices of the breakpoints a client placed itself (segment ``keys``,
    Anthropic ``cache_control``), when the provider can take them as sent: an explicit
    regime, every key a boundary of ``layout``, at most ``max_breakpoints`` of them and
    none below the minimum cacheable prefix.  None: the planner places them instead."""
    if profile.regime is not Regime.EXPLICIT or not keys:
        return None
    where = {b.key: i for i, b in enumerate(layout.boundaries)}
    if any(k not in where for k in keys):
        return None
    marks = tuple(sorted({where[k] for k in keys}))
    if len(marks) > profile.max_breakpoints:
        return None
    if any(layout.boundaries[i].tokens < profile.min_prefix_tokens for i in marks):
        return None
    return marks
