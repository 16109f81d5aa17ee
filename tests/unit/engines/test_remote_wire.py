"""What a remote replica is sent, checked against vLLM's own request models: the same
sampling options reach vLLM as the same ``SamplingParams`` whether the embedded engine
builds them, the generate route parses them or the completions route converts them;
and the generate route's answers become the engine's chunks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest as VllmGenerate

from engines.base import GenerateRequest, SamplingOptions, Structured
from engines.vllm.engine import _sampling_params
from engines.vllm.remote_wire import choice_chunk, request_body, usage_chunk

PROMPT = (11, 12, 13, 14)
RICH = SamplingOptions(
    max_tokens=7,
    temperature=0.3,
    top_p=0.9,
    top_k=5,
    stop=("END",),
    seed=42,
    presence_penalty=0.1,
    frequency_penalty=0.2,
    ignore_eos=True,
    n=2,
    logprobs=3,
    structured=Structured(regex="[a-z]+"),
    logit_bias=((17, 5.0),),
    min_p=0.05,
    repetition_penalty=1.1,
    min_tokens=2,
    stop_token_ids=(99,),
    include_stop_str_in_output=True,
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
    bad_words=("nope",),
    allowed_token_ids=(17, 18, 19),
)
PLAIN = SamplingOptions(max_tokens=16)
COMPARED = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "n",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "bad_words",
    "allowed_token_ids",
)


def _request(s: SamplingOptions) -> GenerateRequest:
    return GenerateRequest("req-1", PROMPT, s, cache_salt="tenant-a", priority=-1)


def _fields(params: Any) -> dict[str, Any]:
    out = {name: getattr(params, name) for name in COMPARED}
    for name in ("stop", "stop_token_ids", "bad_words"):  # None and [] both say "none"
        out[name] = list(out[name] or [])
    so = params.structured_outputs
    out["structured"] = None if so is None else (so.regex, so.disable_any_whitespace)
    return out


def _wire(body: dict[str, Any]) -> dict[str, Any]:
    return dict(json.loads(json.dumps(body)))  # as the replica reads it


@pytest.mark.parametrize("options", [RICH, PLAIN], ids=["every option", "defaults"])
def test_every_route_gives_vllm_the_same_sampling_params(options: SamplingOptions) -> None:
    embedded = _fields(_sampling_params(_request(options)))
    asked = {name: getattr(options, name) for name in COMPARED}  # what the request said
    asked |= {"stop": list(options.stop), "structured": None}
    asked |= {
        "logit_bias": dict(options.logit_bias) or None,
        "bad_words": list(options.bad_words),
        "stop_token_ids": list(options.stop_token_ids),
    }
    if options.allowed_token_ids is not None:
        asked["allowed_token_ids"] = list(options.allowed_token_ids)
    if options.structured is not None:
        asked["structured"] = (options.structured.regex, not options.structured.any_whitespace)
    assert embedded == asked
    generate = VllmGenerate.model_validate(_wire(request_body("generate", _request(options), "m")))
    completion = CompletionRequest.model_validate(
        _wire(request_body("completions", _request(options), "m"))
    )
    assert _fields(generate.sampling_params) == embedded
    assert _fields(completion.to_sampling_params(options.max_tokens, {})) == embedded
    assert generate.token_ids == list(PROMPT) and completion.prompt == list(PROMPT)
    for parsed in (generate, completion):
        assert parsed.cache_salt == "tenant-a" and parsed.priority == -1
        assert parsed.request_id == "req-1" and parsed.stream is True


def test_the_generate_route_answers_text_and_a_whole_answer_when_prompt_logprobs_are_asked() -> (
    None
):
    body = request_body("generate", _request(PLAIN), "m")
    assert body["output_mode"] == "text" and body["stream_options"] == {"include_usage": True}
    whole = request_body("generate", _request(SamplingOptions(4, prompt_logprobs=1)), "m")
    assert whole["stream"] is False and "stream_options" not in whole
    assert VllmGenerate.model_validate(_wire(whole)).sampling_params.prompt_logprobs == 1


def test_coalesced_outputs_are_asked_of_the_engine_and_the_generate_route_only() -> None:
    coalesced = _request(SamplingOptions(max_tokens=32, stream_interval=32))
    assert _sampling_params(coalesced).stream_interval == 32
    generate = _wire(request_body("generate", coalesced, "m"))
    assert VllmGenerate.model_validate(generate).sampling_params.stream_interval == 32
    # vLLM's completions request has no such field (it would log it as ignored)
    assert "stream_interval" not in request_body("completions", coalesced, "m")
    assert _sampling_params(_request(PLAIN)).stream_interval is None


def test_a_generate_choice_becomes_an_engine_chunk() -> None:
    choice = {
        "index": 1,
        "text": " ab",
        "token_ids": [5, 6],
        "finish_reason": "stop",
        "stop_reason": "END",
        "logprobs": {
            "content": [
                {
                    "token": " a",
                    "logprob": -0.5,
                    "bytes": [32, 97],
                    "top_logprobs": [
                        {"token": " c", "logprob": -2.0},
                        {"token": " a", "logprob": -0.5},
                    ],
                },
                {"token": "b", "logprob": -9999.0, "top_logprobs": []},
            ]
        },
    }
    chunk = choice_chunk("generate", choice, num_prompt=4)
    assert (chunk.text, chunk.token_ids, chunk.index) == (" ab", (5, 6), 1)
    assert chunk.finish_reason == "stop" and chunk.stop_sequence == "END"
    first, second = chunk.logprobs
    assert (first.token, first.logprob, first.token_id) == (" a", -0.5, 5)
    assert first.top == ((" a", -0.5), (" c", -2.0))  # most likely first
    assert (second.token, second.token_id, second.top) == ("b", 6, ())
    assert choice_chunk("generate", {"text": "", "token_ids": [7]}, 4).logprobs == ()
    usage = usage_chunk({"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}}, 4)
    assert (usage.num_prompt_tokens, usage.num_cached_tokens) == (4, 0)


def test_each_request_gets_parameters_of_its_own_that_vllm_copies_shallowly() -> None:
    request = _request(RICH)
    params, again = _sampling_params(request), _sampling_params(request)
    assert params is not again and params.stop is not again.stop  # nothing shared
    copy = params.clone()  # what vLLM's input processor keeps of them
    assert copy is not params and copy.stop is params.stop  # shallow: no deepcopy
