"""Tools on the real vLLM CPU engine: a forced tool choice (structured outputs), a
required one, a tool round trip that continues its session (rebuilt from the log
before it is sent), and langchain-openai's ``bind_tools`` and
``with_structured_output`` against the gateway.  The demo model has random
weights: these check the wire, not the model's judgement."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import KEY_A, Gateway

pytestmark = pytest.mark.integration

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": PARAMS},
}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED: Any = {  # the forced call, as both tests below ask for it
    "messages": ASK,
    "tools": [WEATHER],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "max_tokens": 120,
    "temperature": 0,
}


def test_a_named_tool_choice_returns_a_call_valid_for_its_schema(gateway: Gateway) -> None:
    c = gateway.client().chat.completions.create(model=gateway.model, **FORCED)
    choice = c.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls: Any = choice.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS)


def test_required_tool_choice_streams_a_call(gateway: Gateway) -> None:
    stream: Any = gateway.client().chat.completions.create(
        model=gateway.model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    deltas: list[Any] = []
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert deltas and deltas[0].function.name == "get_weather" and deltas[0].id
    assert len(deltas) > 1  # the name first, then the arguments as they are decoded
    args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    jsonschema.validate(json.loads(args), PARAMS)


def test_a_tool_round_trip_continues_the_session(gateway: Gateway) -> None:
    client = gateway.client(KEY_A)
    first = client.chat.completions.with_raw_response.create(model=gateway.model, **FORCED)
    call: Any = first.parse().choices[0].message.tool_calls[0]
    follow: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "c": 21}'},
    ]
    second = client.chat.completions.with_raw_response.create(
        model=gateway.model, messages=follow, tools=[WEATHER], max_tokens=4, temperature=0
    )
    # verify-before-send is on: a 200 means the request was rebuilt from the log exactly
    assert second.http_response.status_code == 200
    assert second.headers["x-vcache-session"] == first.headers["x-vcache-session"]
    usage: Any = second.parse().usage
    assert usage.prompt_tokens_details.cached_tokens > 0  # the first turn's prefix


def test_langchain_bind_tools_and_structured_output(gateway: Gateway) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class City(BaseModel):
        city: str = Field(pattern=r"^[A-Za-z]{1,12}$")  # bounded: the model is random

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        base_url=f"{gateway.base_url}/v1",
        api_key=KEY_A,
        model=gateway.model,
        temperature=0,
        max_tokens=120,
    )
    ai: Any = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert set(ai.tool_calls[0]["args"]) == {"city"}

    class Weather(BaseModel):
        city: str = Field(pattern=r"^[A-Za-z]{1,12}$")
        sunny: bool

    out = llm.with_structured_output(Weather).invoke("Describe the weather in Paris.")
    assert isinstance(out, Weather)
