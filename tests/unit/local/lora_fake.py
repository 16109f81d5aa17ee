"""A fake engine that serves LoRA adapters: the in-memory engine, its prefix cache keyed
by the adapter too (as vLLM's is), loads and unloads counted, a load refused as vLLM
refuses one (no adapter there, a rank above the maximum)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from engines.base import GenerateChunk, GenerateRequest
from engines.errors import EngineInputError
from engines.fake import FakeEngine
from engines.lora import LoraRef


class LoraFakeEngine(FakeEngine):
    def __init__(self, *args: Any, max_lora_rank: int = 8, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_lora_rank = max_lora_rank
        self.held: dict[str, LoraRef] = {}
        self.load_calls: list[LoraRef] = []
        self.load_delay_s = 0.0
        self.load_error: Exception | None = None  # raised by the next loads (a sick engine)

    @property
    def lora_enabled(self) -> bool:
        return True

    async def load_adapter(self, adapter: LoraRef) -> None:
        self.load_calls.append(adapter)
        await asyncio.sleep(self.load_delay_s)
        if self.load_error is not None:
            raise self.load_error
        config = Path(adapter.path) / "adapter_config.json"
        if not config.is_file():
            raise EngineInputError(f"no adapter at {adapter.path}", param="lora_path")
        rank = int(json.loads(config.read_text())["r"])
        if rank > self.max_lora_rank:
            raise EngineInputError(
                f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}",
                param="lora_path",
            )
        self.held[adapter.name] = adapter

    async def unload_adapter(self, name: str) -> bool:
        return self.held.pop(name, None) is not None

    async def adapters(self) -> list[LoraRef]:
        return list(self.held.values())

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        if request.lora is not None:  # the adapter's blocks are its own
            key = f"{request.cache_salt}|lora:{request.lora.name}:{request.lora.path}"
            request = dataclasses.replace(request, cache_salt=key)
        async for chunk in super().generate(request):
            yield chunk


def adapter_dir(root: Path, name: str, rank: int = 8) -> Path:
    """A directory that holds an adapter (its config is all the fake reads)."""
    where = root / name
    where.mkdir(parents=True, exist_ok=True)
    (where / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    return where
