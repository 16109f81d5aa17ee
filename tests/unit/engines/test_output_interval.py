"""A streamed answer's outputs read from the embedded engine at most once per
``output_interval_s`` (no engine started: vLLM's own output collector, fed as its output
handler feeds it): what the engine made meanwhile comes as one chunk, every token in
order, the first at once; with no interval, one chunk per output."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.output_processor import RequestOutputCollector

from engines.base import GenerateChunk, GenerateRequest, SamplingOptions
from engines.vllm.engine import VllmEngine
from engines.vllm.engine_config import VllmEngineConfig

TOKENS = 12


def _output(i: int) -> RequestOutput:
    last = i == TOKENS - 1
    done = "length" if last else None
    out = CompletionOutput(0, f"t{i} ", [100 + i], None, None, finish_reason=done)
    return RequestOutput("r", None, [1, 2, 3], None, [out], last, num_cached_tokens=0)


class _LLM:
    """AsyncLLM's generate as it reads its collector; the outputs are put one an event
    loop turn, as the output handler puts each engine step's (the consumer may lag)."""

    def __init__(self) -> None:
        self.q = RequestOutputCollector(RequestOutputKind.DELTA, "r")
        self.aborted: list[str] = []

    async def _produce(self) -> None:
        for i in range(TOKENS):
            self.q.put(_output(i))
            await asyncio.sleep(0)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
        producer = asyncio.create_task(self._produce())
        try:
            finished = False
            while not finished:
                out = self.q.get_nowait() or await self.q.get()
                assert isinstance(out, RequestOutput)
                finished = out.finished
                yield out
        finally:
            await producer

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _chunks(interval_s: float) -> list[GenerateChunk]:
    engine = VllmEngine(VllmEngineConfig("m", "m", output_interval_s=interval_s))
    llm = _LLM()
    engine._llm = llm  # type: ignore[assignment]  # started: its AsyncLLM
    greq = GenerateRequest("r", (1, 2, 3), SamplingOptions(max_tokens=TOKENS))

    async def main() -> list[GenerateChunk]:
        return [c async for c in engine.generate(greq)]

    got = asyncio.run(main())
    assert llm.aborted == []  # it ended: nothing to abort
    return got


def test_outputs_made_within_the_interval_come_as_one_chunk() -> None:
    got = _chunks(0.2)  # longer than the rest of the answer takes: it merges into one
    assert [c.token_ids for c in got] == [(100,), tuple(range(101, 100 + TOKENS))]
    assert "".join(c.text for c in got) == "".join(f"t{i} " for i in range(TOKENS))
    assert [c.finish_reason for c in got] == [None, "length"]


def test_without_an_interval_each_output_is_a_chunk() -> None:
    got = _chunks(0.0)
    assert [c.token_ids for c in got] == [(100 + i,) for i in range(TOKENS)]
    assert got[-1].finish_reason == "length"
