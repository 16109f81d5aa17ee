"""LoRA adapters on an engine: what a request runs under, and the engines that load them.

An adapter is named and found at a path (a directory with PEFT's
``adapter_config.json`` and weights); vLLM keys every prefix-cache block of a
request under an adapter by ``("lora", name, path)``, so the pair is the adapter's
identity (:class:`LoraRef`).  An engine that serves adapters
(:class:`AdapterEngine`) loads and unloads them by that pair and says which it holds;
a load that fails (no adapter there, a rank above the engine's maximum, another
base model's) raises :class:`~engines.errors.EngineInputError` naming why, and the
engine keeps serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class LoraRef:
    """An adapter as vLLM's ``LoRARequest`` names it (and hashes its blocks by); with
    the sha256 of its weights files where the gateway read them (not part of its
    identity: an engine's own list of what it holds carries none)."""

    name: str
    path: str
    sha256: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise ValueError("an adapter has a name and a path")


@runtime_checkable
class AdapterEngine(Protocol):
    """An engine that serves LoRA adapters (the embedded engine and a remote replica)."""

    @property
    def lora_enabled(self) -> bool:
        """Whether it was started with LoRA on (else every load fails)."""
        ...

    async def load_adapter(self, adapter: LoraRef) -> None:
        """Load ``adapter`` (a name loaded at another path is replaced).  Raises
        :class:`~engines.errors.EngineInputError` naming why it cannot be loaded."""

    async def unload_adapter(self, name: str) -> bool:
        """Unload the adapter ``name``; False when it was not loaded."""
        ...

    async def adapters(self) -> list[LoraRef]:
        """The adapters it holds now (an engine may have let one go: least recently used
        beyond its CPU slots)."""
        ...
