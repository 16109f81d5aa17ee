"""The local model's OpenAI features on the real vLLM CPU engine (official SDK): n,
logprobs, structured outputs (vLLM's own machinery), one model by id; the cache
prediction stays exact for all of them."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import httpx
import jsonschema
import pytest

from tests.integration.conftest import KEY_A, Gateway, check_vllm_logprobs, check_vllm_sampling

pytestmark = pytest.mark.integration

SYSTEM = "You answer in JSON about the vcache manual. " * 40  # several 128-token blocks


def _messages(q: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


def _raw(gateway: Gateway, body: dict[str, object]) -> httpx.Response:
    with httpx.Client(base_url=gateway.base_url, timeout=120) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": gateway.model, **body},
            headers={"authorization": f"Bearer {KEY_A}"},
        )
    assert r.status_code == 200, r.text
    return r


def test_n_samples_share_one_prefill_and_the_prediction_holds(gateway: Gateway) -> None:
    body = {
        "messages": _messages("n"),
        "max_tokens": 6,
        "n": 3,
        "seed": 7,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    _raw(gateway, body)  # warm the prefix
    r = _raw(gateway, body)
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 3 * 6
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and int(r.headers["x-vcache-predicted-cached-tokens"]) == cached


def test_logprobs_and_top_logprobs(gateway: Gateway) -> None:
    c = gateway.client().chat.completions.create(
        model=gateway.model,
        messages=_messages("logprobs"),  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,  # greedy: sampled, the random model emits byte fragments now and then
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    for t in lp.content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    assert "".join(t.token for t in lp.content) == c.choices[0].message.content


def test_json_schema_output_is_valid_json_for_the_schema(gateway: Gateway) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "ok": {"type": "boolean"},
            "size": {"enum": ["small", "large"]},
        },
        "required": ["name", "ok", "size"],
        "additionalProperties": False,
    }
    c = gateway.client().chat.completions.create(
        model=gateway.model,
        messages=_messages("json"),  # type: ignore[arg-type]
        max_tokens=200,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "thing", "schema": schema, "strict": True},
            }
        },
    )
    assert c.choices[0].finish_reason == "stop", c.choices[0].message.content
    jsonschema.validate(json.loads(c.choices[0].message.content or ""), schema)


def test_json_object_output_parses(gateway: Gateway) -> None:
    c = gateway.client().chat.completions.create(
        model=gateway.model,
        messages=_messages("json object"),  # type: ignore[arg-type]
        max_tokens=120,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if c.choices[0].finish_reason == "stop":  # a random model may ramble past the limit
        assert isinstance(json.loads(c.choices[0].message.content or ""), dict)
    assert (c.choices[0].message.content or "").lstrip().startswith("{")


@pytest.mark.parametrize(
    ("constraint", "holds"),
    [
        ({"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
    ],
    ids=["choice", "regex", "grammar"],
)
def test_vllm_structured_outputs_constrain_the_real_engine(
    gateway: Gateway, constraint: dict[str, object], holds: Callable[[str], object]
) -> None:
    """vLLM's own ``structured_outputs`` (not OpenAI's response_format), on chat and text."""
    client = gateway.client()
    chat = client.chat.completions.create(
        model=gateway.model,
        messages=_messages("pick"),  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": constraint},
    )
    text = client.completions.create(
        model=gateway.model,
        prompt="pick one:",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": constraint},
    )
    for answer, finish in (
        (chat.choices[0].message.content or "", chat.choices[0].finish_reason),
        (text.choices[0].text, text.choices[0].finish_reason),
    ):
        assert finish == "stop" and holds(answer), answer


def test_prompt_shaping_keeps_the_prediction_exact_on_the_real_engine(gateway: Gateway) -> None:
    """chat_template_kwargs and continue_final_message are rendered by vcache's template
    path: vLLM counts the same prompt tokens and the predicted cached tokens are its own."""
    partial = [*_messages("shape"), {"role": "assistant", "content": "It is"}]
    asks: list[dict[str, object]] = [
        {"messages": _messages("shape"), "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": _messages("shape"), "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
    ]
    seen = []
    for body in asks:
        r = _raw(gateway, {**body, "max_tokens": 2, "temperature": 0})
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        seen.append((int(r.headers["x-vcache-predicted-cached-tokens"]), cached))
    assert all(p == c for p, c in seen), seen
    assert seen[1][1] > 0  # the shaped prompt was cached as shaped


def test_a_cache_salt_isolates_within_the_tenant_and_stays_predicted(gateway: Gateway) -> None:
    """vLLM's cache_salt: the same prompt under another salt shares no cached span, and
    the prediction knows it."""
    seen = []
    for salt in ("user-1", "user-1", "user-2"):
        body = {"messages": _messages("salted"), "max_tokens": 2, "cache_salt": salt}
        r = _raw(gateway, body)
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        seen.append((int(r.headers["x-vcache-predicted-cached-tokens"]), cached))
    assert all(p == c for p, c in seen), seen
    assert seen[1][1] > 0 and seen[2][1] == 0  # shared under one salt, not across two


def test_retrieve_the_model(gateway: Gateway) -> None:
    m = gateway.client().models.retrieve(gateway.model)
    assert m.id == gateway.model


def test_logit_bias_steers_the_real_engine(gateway: Gateway) -> None:
    """A +100 bias on one token makes vLLM sample it every step (the repro of issue 22:
    the bias used to change nothing)."""
    client = gateway.client(KEY_A)
    biased = client.completions.create(
        model=gateway.model,
        prompt="probe 5",
        max_tokens=4,
        temperature=0,
        logprobs=0,
        logit_bias={"1500": 100},
    )
    plain = client.completions.create(
        model=gateway.model, prompt="probe 5", max_tokens=4, temperature=0, logprobs=0
    )
    lp, other = biased.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and other is not None and lp.tokens is not None
    assert len(set(lp.tokens)) == 1 and lp.tokens != other.tokens
    assert lp.top_logprobs is not None
    assert all(t in top for t, top in zip(lp.tokens, lp.top_logprobs, strict=True))


def test_vllm_sampling_extensions_steer_the_real_engine(gateway: Gateway) -> None:
    check_vllm_sampling(gateway.base_url, gateway.model, {"authorization": f"Bearer {KEY_A}"})
    check_vllm_logprobs(gateway.base_url, gateway.model, {"authorization": f"Bearer {KEY_A}"})


def test_tokenize_gives_the_ids_and_block_hashes_the_request_path_uses(gateway: Gateway) -> None:
    """/tokenize of a chat request: the prompt tokens vLLM counts for the same request, and
    the block hashes the cache API (and the index) key those tokens by."""
    messages = _messages("tokenize me " * 80)
    auth = {"authorization": f"Bearer {KEY_A}"}
    with httpx.Client(base_url=gateway.base_url, headers=auth, timeout=120) as c:
        tok = c.post("/tokenize", json={"model": gateway.model, "messages": messages})
        assert tok.status_code == 200, tok.text
        body = tok.json()
        ask = {"model": gateway.model, "messages": messages, "max_tokens": 1}
        chat = c.post("/v1/chat/completions", json=ask)
        assert chat.json()["usage"]["prompt_tokens"] == body["count"] == len(body["tokens"])
        found = c.post("/v1/cache/lookup", json={"model": gateway.model, "messages": messages})
        replicas = found.json()["replicas"]
        assert body["block_hashes"] and body["block_hashes"] == replicas[0]["block_hashes"]
        back = c.post("/detokenize", json={"model": gateway.model, "tokens": body["tokens"][:20]})
        assert back.status_code == 200 and back.json()["prompt"]
