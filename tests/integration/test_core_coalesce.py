"""A request's outputs coalesced in the engine core (engines/vllm/core_coalesce.py), on
the real CPU engine: what crosses from the engine core to vLLM's output processor in
the gateway's process is the outputs that processor lets through, not one a step.

An embedded replica as ``vcache serve`` builds it (vcache's scheduler class on, its
default), three answers of 24 tokens at once: sent whole (``stream_interval`` 24),
streamed every 4 tokens, streamed each token.  The outputs the frontend's output
processor receives are counted (exact: counted as they arrive, however fast the answers
are read; the chunks relayed may merge outputs a slow reader had not taken)."""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engines.base import GenerateChunk, GenerateRequest, SamplingOptions
from gateway.local.build import build_replicas
from tests.integration.conftest import embedded_settings

pytestmark = pytest.mark.integration

TOKENS = 24


def _request(rid: str, every: int | None) -> GenerateRequest:
    sampling = SamplingOptions(
        max_tokens=TOKENS, temperature=0.0, ignore_eos=True, stream_interval=every
    )
    prompt = tuple(range(100 + len(rid), 160 + len(rid)))  # its own prompt, no shared prefix
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)


def test_the_core_sends_the_outputs_the_frontend_lets_through(data_dir: Path) -> None:
    settings = embedded_settings(data_dir)
    received: Counter[str] = Counter()  # EngineCoreOutputs reaching the output processor
    chunks: dict[str, list[GenerateChunk]] = {}

    async def main(runtime: Path) -> None:
        (replica,) = build_replicas(settings, runtime)
        engine: Any = replica.engine
        await engine.start()
        try:
            processor = engine._llm.output_processor  # vLLM's, in this process
            process = processor.process_outputs

            def counted(outputs: Any, *args: Any, **kwargs: Any) -> Any:
                # vLLM's internal ids: the request's own, a suffix added
                received.update(o.request_id.rsplit("-", 1)[0] for o in outputs)
                return process(outputs, *args, **kwargs)

            processor.process_outputs = counted
            asks = {"whole": TOKENS, "every-4": 4, "each": None}

            async def run(rid: str, every: int | None) -> None:
                chunks[rid] = [c async for c in engine.generate(_request(rid, every))]

            await asyncio.gather(*(run(rid, every) for rid, every in asks.items()))
        finally:
            await engine.close()

    with tempfile.TemporaryDirectory(prefix="vcache-") as runtime:
        asyncio.run(main(Path(runtime)))

    tokens = {rid: [len(c.token_ids) for c in got] for rid, got in chunks.items()}
    print(f"\ntokens a chunk: {tokens}; outputs from the core: {dict(received)}")
    assert all(sum(n) == TOKENS for n in tokens.values())  # every token relayed
    # vLLM's scheduler sends an output a step (24 each); vcache's, those its output
    # processor lets through: the first token, every 4 (or all 23 left), the last
    assert received == {"whole": 2, "every-4": 7, "each": TOKENS}
