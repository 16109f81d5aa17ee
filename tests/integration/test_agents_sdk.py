"""The openai-agents SDK's default model (the Responses API) on the real vLLM CPU engine:
an agent with a function tool and a typed output, the tool forced on its first turn,
completes the round trip (the call, the SDK runs the tool, the output goes back as a
``function_call_output`` item, the model answers in the output's JSON schema, which
``text.format`` carries).  The demo model has random weights: this checks the wire, not
the model's judgement (its free text would run to the token limit, an incomplete
response the SDK refuses; the schema makes it end)."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    RunResult,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.integration.conftest import KEY_A, Gateway

pytestmark = pytest.mark.integration


class Where(BaseModel):
    replica: Literal["r0", "r1"]


def test_agent_with_a_forced_tool_completes_a_round_trip(gateway: Gateway) -> None:
    set_tracing_disabled(True)  # no exporter: nothing leaves the machine
    seen: list[str] = []

    @function_tool
    def lookup_span(name: Literal["system", "tools"]) -> str:
        """Look up a KV span by name (an enum: a random model's free string never ends)."""
        seen.append(name)
        return "span 7: 12 blocks resident on replica 0"

    async def main() -> RunResult:
        # the client closed on the loop its connections were made on, before it ends
        async with AsyncOpenAI(
            base_url=f"{gateway.base_url}/v1", api_key=KEY_A, max_retries=0
        ) as client:
            agent = Agent(
                name="ops",
                instructions="You answer questions about the KV cache. " * 10,
                tools=[lookup_span],
                output_type=Where,
                model=OpenAIResponsesModel(model=gateway.model, openai_client=client),
                model_settings=ModelSettings(
                    tool_choice="lookup_span", max_tokens=120, temperature=0.0, store=True
                ),
            )
            return await Runner.run(
                agent, "Where is span 7?", max_turns=4, run_config=RunConfig(tracing_disabled=True)
            )

    result = asyncio.run(main())
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert len(seen) == 1  # the SDK ran the tool once, with the constrained arguments
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, Where)
    responses = result.raw_responses
    assert len(responses) == 2
    second = responses[1].usage
    # the second turn re-sent the first turn's prompt: it was served from the prefix cache
    assert second.input_tokens_details.cached_tokens > 0
    assert second.input_tokens > responses[0].usage.input_tokens
