"""How many tokens one output of a streamed answer carries: vLLM's ``stream_interval``.

A streamed answer's outputs are read from an embedded engine at most once per
``engine.output_interval_ms``, so one SSE event carries the tokens made meanwhile;
but vLLM's output processor (in the gateway's process) still builds an output and
merges it into the request's collector at every engine step.  Where the engine makes
several tokens per interval, it is asked for one output every N tokens instead (the
first token at once, then every N, and the last: vLLM's ``stream_interval``, as its
own server offers), which the client cannot tell from the interval's merge.  Under
vcache's scheduler class (its default) the engine core applies the same rule where the
outputs are made (engines/vllm/core_coalesce.py): the outputs held back never reach the
gateway's process at all, neither as a message to decode nor as work for vLLM's
output processor.

N is decided at prepare, from the pace the serving replicas report
(``EngineStats.token_gap_s``), before the journal: it is part of the sampling the
session log records and vLLM is sent, never changed after.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from engines.base import SamplingOptions


def stream_interval(gap_s: float | None, interval_s: float, max_tokens: int) -> int | None:
    """The tokens per output for a streamed answer: as many as the engine makes in
    ``interval_s`` at ``gap_s`` a token, when that is 2 or more and fewer than
    ``max_tokens`` (one output per token otherwise, read at most once per interval);
    None when the pace is unknown or the interval is 0 (each output as it comes)."""
    if gap_s is None or gap_s <= 0 or interval_s <= 0:
        return None
    n = math.floor(interval_s / gap_s + 1e-9)  # 0.020 / 0.005 is 4, not 3.999...
    return n if 2 <= n < max_tokens else None


@dataclass(frozen=True)
class Pace:
    """The serving replicas' pace (``gap_s`` a token per request, None: unknown) and the
    interval a streamed answer's outputs are read at (``engine.output_interval_ms``)."""

    gap_s: float | None
    interval_s: float

    def every(self, max_tokens: int) -> int | None:
        """:func:`stream_interval` for an answer of at most ``max_tokens``."""
        return stream_interval(self.gap_s, self.interval_s, max_tokens)


def slowest(gaps: Iterable[float | None]) -> float | None:
    """The pace to coalesce by over replicas the request may be routed to: the longest
    gap (the fewest tokens per output), None when any replica's is unknown (or none)."""
    out: float | None = None
    for g in gaps:
        if g is None:
            return None
        out = g if out is None else max(out, g)
    return out


def streamed(sampling: SamplingOptions) -> bool:
    """Whether the answer's outputs are relayed as they come (a streamed answer, each
    output one token or ``stream_interval`` of them), not only its first and last (an
    answer sent whole: its ``stream_interval`` covers its ``max_tokens``)."""
    every = sampling.stream_interval
    return every is None or every < sampling.max_tokens
