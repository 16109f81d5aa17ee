"""An answer's text made an output at a time in the engine adapter: output by output the
same text vLLM's own detokenizer makes of it (the demo model's byte-level tokenizer,
random ids: partial characters, stray bytes and special tokens included)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engines.base import EngineImage, GenerateRequest, SamplingOptions
from engines.vllm.detokenize import AnswerText, byte_level, detokenized_here


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Any:
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(demo_model))


def _request(prompt: list[int], **sampling: Any) -> GenerateRequest:
    fields: dict[str, Any] = {"max_tokens": 64} | sampling
    return GenerateRequest(
        request_id="r", prompt_token_ids=tuple(prompt), sampling=SamplingOptions(**fields)
    )


def _params(request: GenerateRequest) -> Any:
    from vllm import SamplingParams

    s = request.sampling
    return SamplingParams(
        max_tokens=s.max_tokens,
        skip_special_tokens=s.skip_special_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
        detokenize=False,  # as the engine asks vLLM for such a request
    )


def _vllms(
    tokenizer: Any, request: GenerateRequest, outputs: list[list[int]], ended: bool
) -> list[str]:
    """Each output's text as vLLM's output processor makes it: its detokenizer fed the
    outputs one by one (the last output's last token ended the answer where
    ``ended``), the text each adds."""
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    req = SimpleNamespace(
        request_id="r",
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=_params(request),
    )
    d = FastIncrementalDetokenizer(tokenizer, req)  # type: ignore[arg-type]
    texts = []
    for i, out in enumerate(outputs):
        last = i == len(outputs) - 1
        d.update(out, ended and last)
        texts.append(d.get_next_output_text(finished=last, delta=True))
    return texts


def _ours(
    tokenizer: Any, request: GenerateRequest, outputs: list[list[int]], ended: bool
) -> list[str]:
    answer = AnswerText(tokenizer, request, _params(request))
    return [
        answer.add(0, out, i == len(outputs) - 1, ended and i == len(outputs) - 1)
        for i, out in enumerate(outputs)
    ]


def _split(ids: list[int], rng: random.Random, outputs: int) -> list[list[int]]:
    cuts = sorted(rng.sample(range(1, len(ids)), min(outputs - 1, len(ids) - 1)))
    return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]


def _no_vllm(*_: Any) -> Any:
    raise AssertionError("vLLM's detokenizer ran")


def test_the_demo_tokenizer_decodes_byte_level(tokenizer: Any) -> None:
    assert byte_level(tokenizer)
    assert not byte_level(object())  # not vLLM's fast tokenizer: vLLM detokenizes


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("include_stop", [False, True])
def test_random_answers_read_output_by_output_as_vllm_reads_them(
    tokenizer: Any, skip: bool, include_stop: bool
) -> None:
    rng = random.Random(f"{skip}{include_stop}")
    vocab = len(tokenizer)
    for _ in range(1000):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 48))]
        ended = rng.random() < 0.3
        request = _request(
            prompt, skip_special_tokens=skip, include_stop_str_in_output=include_stop
        )
        # a whole answer's two outputs (its first token, the rest), a streamed one's many
        for outputs in (_split(ids, rng, 2), _split(ids, rng, rng.randint(3, 20))):
            assert _ours(tokenizer, request, outputs, ended) == _vllms(
                tokenizer, request, outputs, ended
            )


def test_text_of_whole_characters_is_one_decode_an_output(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = tokenizer.encode("The question: what is a prefix cache?")
    ids = tokenizer.encode(" A cache of KV blocks — keyed by what precedes them, ünïcödé too.")
    request = _request(prompt)
    outputs = _split(ids, random.Random(1), 5)
    expected = _vllms(tokenizer, request, outputs, False)
    monkeypatch.setattr(AnswerText, "_vllm", _no_vllm)
    assert _ours(tokenizer, request, outputs, False) == expected
    assert "ünïcödé" in "".join(expected)


def test_a_character_split_over_two_outputs_waits_for_its_last_byte(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = tokenizer.encode("Say the price.")
    euro = tokenizer.encode("€")
    assert len(euro) > 1  # bytes the stream holds back until the character is whole
    outputs = [tokenizer.encode(" It costs 5") + euro[:-1], euro[-1:]]
    request = _request(prompt)
    expected = _vllms(tokenizer, request, outputs, False)
    monkeypatch.setattr(AnswerText, "_vllm", _no_vllm)
    assert _ours(tokenizer, request, outputs, False) == expected == [" It costs 5", "€"]


def test_a_prompt_ending_within_a_character_keeps_vllms_detokenizer(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Say the price in €")
    prompt = prompt[:-1]  # half the euro sign: vLLM's stream starts from the prompt's text
    ids = tokenizer.encode(" five")
    request = _request(prompt)
    answer = AnswerText(tokenizer, request, _params(request))
    assert answer.add(0, ids, True, False) == "".join(_vllms(tokenizer, request, [ids], False))
    assert 0 in answer._vllms  # its own detokenizer ran


def test_what_reads_the_text_token_by_token_keeps_vllms_detokenizer() -> None:
    prompt = [1, 2, 3]
    assert detokenized_here(_request(prompt))
    assert detokenized_here(_request(prompt, stream_interval=64))  # whole
    assert not detokenized_here(_request(prompt, stop=("\n",)))
    assert not detokenized_here(_request(prompt, logprobs=0))
    assert not detokenized_here(_request(prompt, prompt_logprobs=0))
    assert not detokenized_here(
        _request(prompt, skip_special_tokens=False, spaces_between_special_tokens=False)
    )
    assert detokenized_here(_request(prompt, skip_special_tokens=False))
    image = EngineImage(b"x", "image/png", "i")
    with_image = GenerateRequest(
        request_id="r",
        prompt_token_ids=(1, 2),
        sampling=SamplingOptions(max_tokens=8),
        images=(image,),
        template_token_ids=(1,),
    )
    assert not detokenized_here(with_image)
