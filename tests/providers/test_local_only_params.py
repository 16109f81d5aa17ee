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
        ({"top_k": 5}, "top_k"),
        ({"min_p": 0.1}, "min_p"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [7]}, "stop_token_ids"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"bad_words": ["no"]}, "bad_words"),
        ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"cache_salt": "user-1"}, "cache_salt"),
        ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ({"return_token_ids": True}, "return_token_ids"),
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"echo": True}, "echo"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "continuous_usage_stats",
        ),
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
