"""Parameters only the local model serves: a hosted-provider target refuses them by
name, and an alias moves past it to the next target that can serve them."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engines.tokenizer import ChatTokenizer
from tests.providers.conftest import MODELS, Emulator, Gw, make_gateway

OPENAI = f"openai/{MODELS['openai']}"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"12": 5}}, "logit_bias"),
    ],
)
def test_a_provider_target_refuses_them_by_name(
    gw: Gw, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        gw.client().chat.completions.create(
            model=OPENAI, messages=HELLO, max_tokens=4, extra_body=extra
        )
    err = info.value.body
    assert isinstance(err, dict)
    assert err["param"] == param and err["code"] == "unsupported_on_target"
    assert gw.emulator.received() == []  # nothing was sent


@pytest.fixture
def gw_alias(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    aliases = {"anthropic-then-local": [f"anthropic/{MODELS['anthropic']}", "local"]}
    yield from make_gateway(emulator, tokenizer, aliases=aliases)


def test_an_alias_falls_back_to_the_target_that_serves_them(gw_alias: Gw) -> None:
    raw = gw_alias.client().chat.completions.with_raw_response.create(
        model="anthropic-then-local", messages=HELLO, max_tokens=3, n=2
    )
    c = raw.parse()
    assert len(c.choices) == 2
    assert raw.headers["x-vcache-target"] == "local"
    assert raw.headers["x-vcache-fallback-from"] == f"anthropic/{MODELS['anthropic']}"
