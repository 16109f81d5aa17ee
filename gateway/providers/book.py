"""Verify, then account (shared/seeds/002), for the hosted-provider targets.

Per target, a :class:`PromptView` names each segment boundary of a rendered
prompt: its byte end, its estimated tokens and the digest of every byte
before it (salted with tenant and target).  :class:`ProviderCacheBook`
keeps what the gateway believes is warm (``manifest.belief``), the render
record of the request that warmed each prefix (``manifest.records``) and
the savings ledger (``manifest.ledger``).  After each answer,
:meth:`ProviderCacheBook.settle` folds the provider's usage telemetry:
a believed-warm prefix that reads cold is a false-warm (with the first
diverging byte, or none when the bytes matched and the provider evicted
it), and savings are credited only for reported cached tokens covered by
a marker whose prefix still renders byte-identically.

Token counts here are the gateway's estimates; a provider counts its own.
Each answer's ``prompt_tokens`` gives the ratio between the two, and a
tolerance of one cache step absorbs what is left.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engines.providers.base import MediaSpan, ProviderUsage, estimate_tokens
from gateway.core.facts import Publish, no_one
from manifest.belief import Telemetry, WarmthBelief
from manifest.canonical import SegmentKind
from manifest.identity import ContentDigest, prefix_digests
from manifest.ledger import PriceTable, SavingsLedger
from manifest.planner import Boundary, CapabilityProfile, PromptLayout, Regime
from manifest.records import (
    MarkerAt,
    MarkerRecord,
    RenderRecord,
    Verified,
    make_record,
    verify,
)


def _kind(key: str) -> SegmentKind:
    if key == "tools":
        return SegmentKind.TOOL_SCHEMA
    if key == "system":
        return SegmentKind.STABLE
    return SegmentKind.VOLATILE if key == "system:volatile" else SegmentKind.MESSAGE


# a provider frames each block of a prompt with tokens of its own, which the estimate
# (4 bytes a token, one prompt-wide calibration) spreads evenly: a prefix much shorter
# than its prompt (a read of the system prompt alone, its turns changed) may count a few
# percent fewer tokens than its calibrated estimate.  Explicit caches only: their reads
# land on breakpoints thousands of tokens apart, so this slack never takes one breakpoint
# for another (an implicit cache's read may end anywhere, a step at a time).
FRAMING_SLACK = 0.03


@dataclass(frozen=True)
class PromptView:
    target: str
    prompt: bytes = field(repr=False)
    keys: tuple[str, ...]
    ends: tuple[int, ...]
    tokens: tuple[int, ...]  # cumulative estimate through each boundary
    digests: tuple[ContentDigest, ...]
    # of ``tokens``, the images' (counted by the provider's own rule, so never scaled)
    media_tokens: tuple[int, ...] = ()
    media: tuple[MediaSpan, ...] = ()  # where each image's bytes sit in ``prompt``

    @classmethod
    def of(
        cls,
        target: str,
        salt: str,
        prompt: bytes,
        ends: dict[str, int],
        keys: list[str],
        media: tuple[MediaSpan, ...] = (),
    ) -> PromptView:
        """``media``: the images in ``prompt``, each counted as the provider counts it
        (its base64 is no measure), the rest 4 bytes a token."""
        head = f"{salt}\0{target}\0".encode()
        byte_ends = tuple(ends[k] for k in keys)
        digests = prefix_digests(prompt, byte_ends, head)
        return cls(
            target,
            prompt,
            tuple(keys),
            byte_ends,
            tuple(estimate_tokens(e, media) for e in byte_ends),
            tuple(digests[e] for e in byte_ends),
            tuple(sum(m.tokens for m in media if m.end <= e) for e in byte_ends),
            media,
        )

    @property
    def total_tokens(self) -> int:
        return self.tokens[-1] if self.tokens else 0

    def _media(self, i: int) -> int:
        return self.media_tokens[i] if self.media_tokens else 0

    def calibration(self, provider_prompt_tokens: int) -> float:
        """The provider's tokens per estimated text token on this prompt: its images are
        counted by the provider's own rule already, so only the text is scaled (one
        prompt-wide factor over text and images alike scales a text-only prefix past
        what the provider read, when the images weigh more or less than their share)."""
        images = self._media(len(self.tokens) - 1) if self.tokens else 0
        text = self.total_tokens - images
        return (provider_prompt_tokens - images) / text if text > 0 else 1.0

    def scaled(self, i: int, scale: float) -> float:
        """Boundary ``i``'s tokens as the provider counts them (``scale``:
        :meth:`calibration`)."""
        images = self._media(i)
        return (self.tokens[i] - images) * scale + images

    def layout(self) -> PromptLayout:
        return PromptLayout(
            tuple(Boundary(k, _kind(k), t) for k, t in zip(self.keys, self.tokens, strict=True))
        )

    def anchor(self) -> int:
        """The index of the anchor: the last boundary of the stable head (-1: none)."""
        return self.layout().stable_end()

    def marker(self, i: int) -> MarkerAt:
        return MarkerAt(self.keys[i], self.ends[i], self.tokens[i])

    def markers(self) -> dict[str, MarkerAt]:
        return {k: self.marker(i) for i, k in enumerate(self.keys)}

    def part_at(self, offset: int | None) -> str | None:
        """The part of the prompt byte ``offset`` falls in: an image (``image
        sha256:<digest>``, the one whose bytes changed or went) or the segment
        (``message:3``); None past the end or for no offset."""
        if offset is None:
            return None
        for m in self.media:
            if m.start <= offset < m.end:
                return f"image sha256:{m.digest}"
        return next((k for k, end in zip(self.keys, self.ends, strict=True) if offset < end), None)


@dataclass
class TargetStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    written_tokens: int = 0
    false_warm: int = 0
    last_false_warm_offset: int | None = None
    last_false_warm_part: str | None = None  # the part that byte is in (PromptView.part_at)

    def as_dict(self) -> dict[str, Any]:
        rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "written_tokens": self.written_tokens,
            "hit_rate": round(rate, 4),
            "false_warm": self.false_warm,
            "last_false_warm_offset": self.last_false_warm_offset,
            "last_false_warm_part": self.last_false_warm_part,
        }


@dataclass(frozen=True)
class Settlement:
    believed_warm_tokens: int
    false_warm: bool
    broken_at: int | None
    credited_tokens: int
    unverified_tokens: int
    broken_part: str | None = None  # the part the first diverging byte is in


@dataclass(frozen=True)
class Believed:
    index: int | None  # the longest boundary believed warm
    tokens: int
    probability: float


class ProviderCacheBook:
    """Belief, records, ledger and stats of the hosted-provider targets.

    Active-active: what this gateway learns goes out through ``publish`` as facts
    (``warm``: the prefixes an answer left warm with their render record; ``cold``: a
    believed prefix read cold), and :meth:`learn_warm` / :meth:`learn_cold` take the
    other gateways'.  The ledger is not shared: each gateway credits the answers it
    settled, so a warm written through one and read through another is credited once.
    """

    def __init__(self, clock: Callable[[], float], publish: Publish = no_one) -> None:
        self._clock = clock
        self.publish = publish
        self.belief = WarmthBelief()
        self.ledger = SavingsLedger()
        self._records: dict[tuple[str, ContentDigest], RenderRecord] = {}
        self.stats: dict[str, TargetStats] = {}
        self._settled = 0

    def believed(self, view: PromptView) -> Believed:
        now = self._clock()
        for i in range(len(view.keys) - 1, -1, -1):
            p = self.belief.probability(view.target, view.digests[i], now)
            if p >= 0.5:
                return Believed(i, view.tokens[i], p)
        return Believed(None, 0, 0.0)

    def settle(
        self,
        request_id: str,
        view: PromptView,
        profile: CapabilityProfile,
        prices: PriceTable,
        believed: Believed,
        marked: tuple[str, ...],
        usage: ProviderUsage,
        ttl_s: float,
        long_keys: tuple[str, ...] = (),
        long_ttl_s: float = 0.0,
    ) -> Settlement:
        """Fold one answer's telemetry: belief, ledger, records, stats.  Breakpoints in
        ``long_keys`` were written at the long tier and live ``long_ttl_s``."""
        now = self._clock()
        target = view.target
        scale = view.calibration(usage.prompt_tokens)
        step = max(profile.granularity, 16)  # tolerance: one cache step, at least 16
        st = self.stats.setdefault(target, TargetStats())
        st.requests += 1
        st.prompt_tokens += usage.prompt_tokens
        st.cached_tokens += usage.cached_tokens
        st.written_tokens += usage.cache_write_tokens
        false_warm, broken_at = False, None
        verified = Verified((), ())
        if believed.index is not None:
            i = believed.index
            expected = view.scaled(i, scale)
            framing = expected * FRAMING_SLACK if profile.regime is Regime.EXPLICIT else 0.0
            slack = step + math.ceil(framing)
            covered = usage.cached_tokens + slack >= expected
            result = self.belief.fold(
                Telemetry(
                    target,
                    view.digests[i],
                    view.tokens[i],
                    view.tokens[i] if covered else 0,
                    view.prompt[: view.ends[i]],
                    now,
                )
            )
            false_warm, broken_at = result.false_warm, result.broken_at
            if false_warm:
                self.publish("cold", {"target": target, "digest": view.digests[i]})
                st.false_warm += 1
                st.last_false_warm_offset = broken_at  # None: the bytes matched (evicted)
                st.last_false_warm_part = view.part_at(broken_at)
            record = self._records.get((target, view.digests[i]))
            if record is not None and not false_warm:
                verified = verify(record, view.prompt, view.markers())
        at = {k: i for i, k in enumerate(view.keys)}  # a kept marker sits where it was
        kept = tuple(
            replace(m, prefix_tokens=math.ceil(view.scaled(at[m.identity], scale)) + step)
            for m in verified.kept
        )
        credit = self.ledger.credit_provider(
            target,
            prices,
            usage.cached_tokens,
            usage.cache_write_tokens,
            Verified(kept, verified.dropped),
        )
        ttls = {k: long_ttl_s for k in long_keys}
        self._remember(request_id, view, profile, marked, usage, scale, ttl_s, ttls, now)
        self._settled += 1
        if self._settled % 256 == 0:
            self._collect(now)
        return Settlement(
            believed.tokens,
            false_warm,
            broken_at,
            credit.credited_tokens,
            credit.unverified_tokens,
            view.part_at(broken_at),
        )

    def _remember(
        self,
        request_id: str,
        view: PromptView,
        profile: CapabilityProfile,
        marked: tuple[str, ...],
        usage: ProviderUsage,
        scale: float,
        ttl_s: float,
        ttls: dict[str, float],
        now: float,
    ) -> None:
        """What this answer left warm: explicit breakpoints that were written or read; for
        implicit caches every boundary past the minimum."""
        minimum = profile.min_prefix_tokens
        if profile.regime is Regime.EXPLICIT:
            if usage.cache_write_tokens + usage.cached_tokens == 0:
                return
            warm = [
                i
                for i, k in enumerate(view.keys)
                if k in marked and view.scaled(i, scale) >= minimum
            ]
        else:
            warm = [
                i
                for i in range(len(view.tokens))
                if view.scaled(i, scale) >= minimum
                and _kind(view.keys[i]) is not SegmentKind.VOLATILE
            ]
        if not warm:
            return
        record = make_record(request_id, view.target, view.prompt, [view.marker(i) for i in warm])
        exact = profile.regime is Regime.EXPLICIT
        shared = memoryview(view.prompt)  # every boundary's bytes are a view of one buffer
        entries = []
        for i in warm:
            d = view.digests[i]
            ttl = ttls.get(view.keys[i], ttl_s)
            self.belief.record_warm(
                view.target, d, view.tokens[i], shared[: view.ends[i]], now, ttl, exact
            )
            self._records[(view.target, d)] = record
            entries.append([d, view.tokens[i], ttl, 0.0])
        self._forget_evicted()
        self.publish("warm", _warm_body(record, exact, entries))

    def _forget_evicted(self) -> None:
        for key in self.belief.take_evicted():  # the belief keeps at most max_entries
            self._records.pop(key, None)

    # -------------------------------------------------- facts of other gateways

    def learn_warm(self, body: dict[str, Any], elapsed: float) -> None:
        """Prefixes another gateway's answer left warm, ``elapsed`` seconds ago (on this
        book's clock), with the render record that lets this gateway verify and credit
        its own later reads of them."""
        target = str(body["target"])
        markers = tuple(
            MarkerRecord(str(a), int(b), int(c), str(d)) for a, b, c, d in body["markers"]
        )
        record = RenderRecord(str(body["request_id"]), target, markers)
        now = self._clock()
        for digest, tokens, ttl, age in body["entries"]:
            d = ContentDigest(str(digest))
            written = now - elapsed - float(age)
            self.belief.record_warm(
                target, d, int(tokens), b"", written, float(ttl), bool(body["exact"])
            )
            self._records[(target, d)] = record
        self._forget_evicted()

    def learn_cold(self, body: dict[str, Any]) -> None:
        """Another gateway read a believed prefix cold: stop believing it."""
        key = (str(body["target"]), ContentDigest(str(body["digest"])))
        if self.belief.forget(*key):
            self._records.pop(key, None)

    def warm_facts(self) -> list[tuple[str, dict[str, Any]]]:
        """What this gateway believes warm, as facts (republished after the store of
        shared state came back empty)."""
        now = self._clock()
        out: list[tuple[str, dict[str, Any]]] = []
        for e in self.belief.entries():
            record = self._records.get((e.target, e.prefix))
            if record is None or e.probability(now) < 0.01:
                continue
            entry = [e.prefix, e.prefix_tokens, e.ttl_s, now - e.last_warmed]
            out.append(("warm", _warm_body(record, e.exact_ttl, [entry])))
        return out

    def _collect(self, now: float) -> None:
        self.belief.expire(now)
        for key in [k for k in self._records if self.belief.get(*k) is None]:
            del self._records[key]

    def count_false_warm(self, target: str, offset: int | None = None) -> None:
        st = self.stats.setdefault(target, TargetStats())
        st.false_warm += 1
        st.last_false_warm_offset = offset

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for target, st in self.stats.items():
            acc = self.ledger.providers.get(target)
            out[target] = {
                **st.as_dict(),
                "credited_tokens": acc.credited if acc else 0,
                "unverified_tokens": acc.unverified if acc else 0,
                "saved_token_equivalents": round(acc.saved, 2) if acc else 0.0,
            }
        return out


def _warm_body(record: RenderRecord, exact: bool, entries: list[list[Any]]) -> dict[str, Any]:
    """A ``warm`` fact: entries are [digest, tokens, ttl_s, age_s] each."""
    return {
        "target": record.target,
        "request_id": record.request_id,
        "exact": exact,
        "markers": [
            [m.identity, m.prefix_bytes, m.prefix_tokens, m.prefix_sha256] for m in record.markers
        ],
        "entries": entries,
    }
