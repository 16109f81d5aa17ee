"""loadtests/vision_prefill.py's pure parts: a request's phases from two scrapes, and the
images it sends (distinct per seed, the size asked)."""

from __future__ import annotations

import io

from PIL import Image

from loadtests.vision_prefill import phase_seconds, png


def test_a_requests_phases_are_the_growth_of_each_phase_over_every_priority() -> None:
    before = {
        'vcache_ttft_phase_seconds_sum{phase="prefill",priority="default"}': 1.0,
        'vcache_ttft_phase_seconds_sum{phase="submit",priority="default"}': 0.5,
        'vcache_ttft_phase_seconds_count{phase="prefill",priority="default"}': 3.0,
    }
    after = {
        'vcache_ttft_phase_seconds_sum{phase="prefill",priority="default"}': 1.25,
        'vcache_ttft_phase_seconds_sum{phase="prefill",priority="batch"}': 0.5,  # a new label
        'vcache_ttft_phase_seconds_sum{phase="submit",priority="default"}': 0.5,
        'vcache_ttft_phase_seconds_count{phase="prefill",priority="default"}': 4.0,
    }
    assert phase_seconds(before, after) == {"submit": 0.0, "prefill": 0.75}


def test_each_seed_is_an_image_of_its_own_at_the_size_asked() -> None:
    a, b = png(320, 240, 1), png(320, 240, 2)
    assert a != b and png(320, 240, 1) == a
    with Image.open(io.BytesIO(a)) as im:
        assert im.size == (320, 240) and im.format == "PNG"
