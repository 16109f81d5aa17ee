"""How many tokens one output of a streamed answer carries (gateway/local/coalesce.py):
as many as the engine makes in an output interval, from 2 up, fewer than the answer's
limit; none coalesced where the pace is unknown or the interval is 0."""

from __future__ import annotations

import pytest

from engines.base import SamplingOptions
from gateway.local.coalesce import Pace, slowest, stream_interval, streamed

CASES = [
    # gap (s), interval (s), max_tokens -> tokens per output
    (0.005, 0.020, 64, 4),  # the demo model on this CPU host under the bench's load
    (0.0049, 0.020, 64, 4),  # floor: 4.08 makes 4
    (0.0051, 0.020, 64, 3),
    (0.010, 0.020, 64, 2),
    (0.011, 0.020, 64, None),  # 1.8 tokens an interval: each output as it comes
    (0.030, 0.020, 64, None),  # a GPU host's 30 ms a token: no change
    (0.001, 0.020, 64, 20),
    (0.005, 0.020, 5, 4),
    (0.005, 0.020, 4, None),  # the whole answer in one output: it is read every interval
    (0.005, 0.0, 64, None),  # engine.output_interval_ms 0: no coalescing at all
    (None, 0.020, 64, None),  # not measured (a remote replica, a fake)
    (0.0, 0.020, 64, None),
]


@pytest.mark.parametrize(("gap", "interval", "max_tokens", "want"), CASES)
def test_tokens_per_output(
    gap: float | None, interval: float, max_tokens: int, want: int | None
) -> None:
    assert stream_interval(gap, interval, max_tokens) == want
    assert Pace(gap, interval).every(max_tokens) == want


def test_the_slowest_replica_sets_the_pace_and_an_unknown_one_none() -> None:
    assert slowest([0.005, 0.008, 0.006]) == 0.008
    assert slowest([0.005, None]) is None
    assert slowest([]) is None


def test_an_answer_sent_whole_is_not_streamed() -> None:
    assert streamed(SamplingOptions(max_tokens=32))  # streamed, each output as it comes
    assert streamed(SamplingOptions(max_tokens=32, stream_interval=4))  # streamed, coalesced
    assert not streamed(SamplingOptions(max_tokens=32, stream_interval=32))  # whole
    assert not streamed(SamplingOptions(max_tokens=1, stream_interval=1))
    assert not streamed(SamplingOptions(max_tokens=0, stream_interval=1))
