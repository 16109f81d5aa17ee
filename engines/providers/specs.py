"""One spec per hosted provider: everything the gateway needs to know of it, in one row.

Adding a provider is one adapter (its wire format) and one :class:`ProviderSpec`
here: the capability profile the planner reads (``manifest.planner``), where
it lives and which environment variable holds its key, and which of the
cache primitives it offers, and whether it sees images and documents (``sees``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engines.providers.anthropic import AnthropicAdapter
from engines.providers.base import Adapter
from engines.providers.gemini import GeminiAdapter
from engines.providers.openai import DeepSeekAdapter, OpenAIAdapter
from manifest.planner import (
    CapabilityProfile,
    anthropic_profile,
    deepseek_profile,
    gemini_profile,
    openai_profile,
)


@dataclass(frozen=True)
class ProviderSpec:
    name: str
    adapter: Callable[[], Adapter]
    profile: Callable[[str, int], CapabilityProfile]  # (model, configured cache TTL in s)
    base_url: str
    key_env: str
    cache_key: bool = False  # routes by a prompt_cache_key (OpenAI)
    cached_contents: bool = False  # explicit cached-content handles (Gemini)
    # takes images and documents (``Turn.parts``); a target whose provider does not is
    # never quoted for a call that carries one
    sees: bool = True


PROVIDERS: dict[str, ProviderSpec] = {
    s.name: s
    for s in (
        ProviderSpec(
            "anthropic",
            AnthropicAdapter,
            anthropic_profile,
            "https://api.anthropic.com/v1",
            "ANTHROPIC_API_KEY",
        ),
        ProviderSpec(
            "openai",
            OpenAIAdapter,
            lambda m, _: openai_profile(m),
            "https://api.openai.com/v1",
            "OPENAI_API_KEY",
            cache_key=True,
        ),
        ProviderSpec(
            "gemini",
            GeminiAdapter,
            lambda m, _: gemini_profile(m),
            "https://generativelanguage.googleapis.com/v1beta",
            "GEMINI_API_KEY",
            cached_contents=True,
        ),
        ProviderSpec(
            "deepseek",
            DeepSeekAdapter,
            lambda m, _: deepseek_profile(m),
            "https://api.deepseek.com",
            "DEEPSEEK_API_KEY",
            sees=False,  # text only: its chat API takes no image or file parts
        ),
    )
}


def adapter_for(provider: str) -> Adapter:
    return PROVIDERS[provider].adapter()


def sees(provider: str) -> bool:
    """Whether ``provider`` takes images and documents."""
    return PROVIDERS[provider].sees
