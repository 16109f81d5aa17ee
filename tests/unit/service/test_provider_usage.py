"""A provider's reported usage through the answer's last piece and back to settle."""

from __future__ import annotations

from engines.providers.base import ProviderUsage
from gateway.service.provider_chat import reported, usage_of


def test_a_reported_usage_comes_back_as_reported() -> None:
    u = ProviderUsage(
        prompt_tokens=1200, cached_tokens=1024, cache_write_tokens=0, completion_tokens=7
    )
    assert reported(usage_of(u)) == u
    written = ProviderUsage(300, 0, 256, 2)
    assert reported(usage_of(written)) == written


def test_no_reported_usage_settles_nothing() -> None:
    usage = usage_of(None)
    assert usage.prompt_tokens == 0 and usage.prompt_tokens_details.cache_write_tokens is None
    assert reported(usage) is None
