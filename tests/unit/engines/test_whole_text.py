"""An answer sent whole, detokenized once at its end: the same text vLLM's own
detokenizer makes of it as the engine's outputs come (the demo model's byte-level
tokenizer, random ids: partial characters and special tokens included)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engines.base import EngineImage, GenerateRequest, SamplingOptions
from engines.vllm.whole_text import WholeText, byte_level, decoded_once


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Any:
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(demo_model))


def _request(prompt: list[int], **sampling: Any) -> GenerateRequest:
    fields: dict[str, Any] = {"max_tokens": 64, "stream_interval": 64} | sampling
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
    )


def _vllms(tokenizer: Any, request: GenerateRequest, outputs: list[list[int]], ended: bool) -> str:
    """vLLM's detokenizer fed the engine's outputs one by one, as its output processor
    feeds it (the last output's last token ended the answer where ``ended``)."""
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    req = SimpleNamespace(
        request_id="r",
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=_params(request),
    )
    d = FastIncrementalDetokenizer(tokenizer, req)  # type: ignore[arg-type]
    for i, out in enumerate(outputs):
        d.update(out, ended and i == len(outputs) - 1)
    return d.get_next_output_text(finished=True, delta=False)


def _split(ids: list[int], rng: random.Random) -> list[list[int]]:
    cut = sorted(rng.sample(range(1, len(ids)), min(3, len(ids) - 1))) if len(ids) > 1 else []
    return [ids[a:b] for a, b in zip([0, *cut], [*cut, len(ids)], strict=True)]


def test_the_demo_tokenizer_decodes_byte_level(tokenizer: Any) -> None:
    assert byte_level(tokenizer)
    assert not byte_level(object())  # not vLLM's fast tokenizer: vLLM detokenizes


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("include_stop", [False, True])
def test_random_answers_read_as_vllms_detokenizer_reads_them(
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
        whole = WholeText(tokenizer, request, _params(request))
        got = whole.add(0, ids[:1], False, False)
        assert got == ""
        got = whole.add(0, ids[1:], True, ended)
        assert got == _vllms(tokenizer, request, _split(ids, rng), ended)


def test_an_answer_of_whole_characters_is_decoded_once(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = tokenizer.encode("The question: what is a prefix cache?")
    ids = tokenizer.encode(" A cache of KV blocks — keyed by what precedes them, ünïcödé too.")
    request = _request(prompt)
    whole = WholeText(tokenizer, request, _params(request))
    expected = _vllms(tokenizer, request, _split(ids, random.Random(1)), False)

    def not_token_by_token(*_: Any) -> str:
        raise AssertionError("decoded token by token")

    monkeypatch.setattr(whole, "_streamed", not_token_by_token)
    assert whole.text(ids, False) == expected
    assert "ünïcödé" in expected


def test_what_reads_the_text_as_it_grows_keeps_vllms_detokenizer() -> None:
    prompt = [1, 2, 3]
    assert decoded_once(_request(prompt))
    assert not decoded_once(_request(prompt, stream_interval=None))  # streamed
    assert not decoded_once(_request(prompt, stream_interval=4))  # streamed, coalesced
    assert not decoded_once(_request(prompt, stop=("\n",)))
    assert not decoded_once(_request(prompt, logprobs=0))
    assert not decoded_once(_request(prompt, prompt_logprobs=0))
    assert not decoded_once(
        _request(prompt, skip_special_tokens=False, spaces_between_special_tokens=False)
    )
    assert decoded_once(_request(prompt, skip_special_tokens=False))
    image = EngineImage(b"x", "image/png", "i")
    with_image = GenerateRequest(
        request_id="r",
        prompt_token_ids=(1, 2),
        sampling=SamplingOptions(max_tokens=8, stream_interval=8),
        images=(image,),
        template_token_ids=(1,),
    )
    assert not decoded_once(with_image)


def test_an_answer_ending_within_a_character_is_decoded_once_too(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = tokenizer.encode("Say the price.")
    euro = tokenizer.encode("€")
    assert len(euro) > 1  # bytes the stream holds back until the character is whole
    ids = tokenizer.encode(" It costs 5") + euro[:-1]
    request = _request(prompt)
    whole = WholeText(tokenizer, request, _params(request))
    expected = _vllms(tokenizer, request, [[i] for i in ids], False)

    def not_token_by_token(*_: Any) -> str:
        raise AssertionError("decoded token by token")

    monkeypatch.setattr(whole, "_streamed", not_token_by_token)
    assert whole.text(ids, False) == expected == " It costs 5"
    assert whole.text([*ids, euro[-1]], False) == " It costs 5€"
