"""What the gateway sends a remote vLLM replica, and how its answers become engine chunks.

Two of vLLM's APIs take token ids, so neither makes the replica apply a chat
template or tokenize:

- ``completions``: the OpenAI ``/v1/completions`` route, on every vLLM server;
  the sampling options travel as top-level fields, which vLLM's completions
  request names as ``SamplingParams`` does (all but ``stream_interval``).
- ``generate``: vLLM's token-in/token-out route ``/inference/v1/generate``
  (a server started with ``--enable-scale-out``); the sampling options travel
  as ``SamplingParams`` itself.  Both take them from
  ``engines.vllm.sampling.sampling_fields``; the generate route's answer text is
  detokenized by the replica (``output_mode: text``, so stop strings and
  logprob strings are the replica's, as on the completions route).

Both stream choices as SSE with a last usage event (``include_usage``); a whole
answer (asked for when prompt logprobs are, which vLLM gives only there)
carries the same choices and usage.

Images go on the generate route only (the completions route takes none with token
ids): the template's ids (one image token per image: the replica expands them, as
the embedded engine's vLLM does) and ``content_parts``, each image a data URL of
its original bytes with the gateway's identifier as its ``uuid``
(:func:`content_parts`).  The first chunk of such an answer carries the ids and
placeholder ranges the replica expanded to (``return_token_ids``), which
:func:`expansion` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from engines.base import LOGPROB_FLOOR, EngineImage, GenerateChunk, GenerateRequest, TokenLogprob
from engines.vllm.sampling import sampling_fields, stop_string
from manifest.attachments import data_url

RemoteApi = Literal["completions", "generate"]
PATHS: dict[RemoteApi, str] = {
    "completions": "/v1/completions",
    "generate": "/inference/v1/generate",
}


def streamed(request: GenerateRequest) -> bool:
    """Whether ``request``'s answer is asked for as a stream: not where vLLM gives prompt
    logprobs only to a whole answer."""
    return request.sampling.prompt_logprobs is None


def request_body(api: RemoteApi, request: GenerateRequest, model: str) -> dict[str, Any]:
    """The JSON body of ``request`` for ``api`` (``stream``: :func:`streamed`)."""
    s = request.sampling
    stream = streamed(request)
    body: dict[str, Any] = {"model": model, "request_id": request.request_id, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    if request.priority:
        body["priority"] = request.priority
    if request.images and api != "generate":
        raise ValueError(f"images go on {PATHS['generate']} only, not {PATHS[api]}")
    if api == "generate":
        body |= {
            "token_ids": list(request.prompt_token_ids),
            "sampling_params": sampling_fields(s),
            "output_mode": "text",
        }
        if request.images:
            assert request.template_token_ids is not None  # GenerateRequest checks it
            body |= {
                "token_ids": list(request.template_token_ids),
                "content_parts": content_parts(request.images),
                "return_token_ids": True,
            }
    else:  # the completions route takes the same fields by the same names, but one
        body |= {"prompt": list(request.prompt_token_ids), "return_token_ids": True}
        body |= sampling_fields(s)
        body.pop("stream_interval", None)  # not a field there: every token is sent
    return body


def content_parts(images: Sequence[EngineImage]) -> list[dict[str, str]]:
    """The images as the generate route's ``content_parts``: each a data URL of the
    client's original bytes (the replica loads it as its chat API loads one, with
    ``ImageMediaIO``: upright, RGB) under the gateway's identifier as its ``uuid``.  vLLM
    takes an item's uuid as its identifier when no processor kwargs are set
    (``ProcessorInputs.get_mm_hashes``), so the replica's ``("mm", identifier, offset)``
    block keys carry the gateway's identifier by construction: the bytes' blake3 the
    gateway computed, or the client's own uuid."""
    return [
        {
            "type": "image_url",
            "url": data_url(i.media_type, i.data),
            "uuid": i.identifier,
        }
        for i in images
    ]


def expansion(data: dict[str, Any]) -> tuple[list[int], list[tuple[int, int]]] | None:
    """The prompt ids and image placeholder ranges (offset, length) a replica reports in an
    image request's first chunk or whole answer; None where the chunk carries none."""
    ids = data.get("prompt_token_ids")
    if ids is None:
        return None
    ranges = (data.get("mm_placeholders") or {}).get("image") or []
    return [int(t) for t in ids], [(int(r["offset"]), int(r["length"])) for r in ranges]


def expansion_differs(
    request: GenerateRequest, ids: Sequence[int], ranges: Sequence[tuple[int, int]]
) -> str | None:
    """How the replica's expansion of ``request``'s images differs from the gateway's (its
    ``prompt_token_ids`` and the images' spans), or None when it is the same."""
    if list(ids) != list(request.prompt_token_ids):
        mine = request.prompt_token_ids
        at = next((i for i, (a, b) in enumerate(zip(ids, mine, strict=False)) if a != b), None)
        at = min(len(ids), len(mine)) if at is None else at
        return f"{len(ids)} prompt tokens against the gateway's {len(mine)}, first apart at {at}"
    spans = [(i.offset, i.length) for i in request.images]
    if list(ranges) != spans:
        return f"image placeholders {list(ranges)} against the gateway's {spans}"
    return None


def choice_chunk(api: RemoteApi, c: dict[str, Any], num_prompt: int) -> GenerateChunk:
    """One answer choice (a stream's or a whole answer's) as an engine chunk."""
    ids = tuple(c.get("token_ids") or ())
    lp = c.get("logprobs")
    return GenerateChunk(
        text=c.get("text") or "",
        token_ids=ids,
        num_prompt_tokens=num_prompt,
        num_cached_tokens=None,  # reported with the final usage
        finish_reason=c.get("finish_reason"),
        index=int(c.get("index") or 0),
        logprobs=_content_logprobs(lp, ids) if api == "generate" else _logprobs(lp, ids),
        stop_sequence=stop_string(c.get("stop_reason")),
    )


def usage_chunk(usage: dict[str, Any], num_prompt: int) -> GenerateChunk:
    details = usage.get("prompt_tokens_details") or {}
    return GenerateChunk(
        text="",
        token_ids=(),
        num_prompt_tokens=int(usage.get("prompt_tokens", num_prompt)),
        num_cached_tokens=int(details.get("cached_tokens") or 0),
    )


def _logprobs(lp: dict[str, Any] | None, ids: Sequence[int]) -> tuple[TokenLogprob, ...]:
    """A completions-API ``logprobs`` object (tokens, token_logprobs, top_logprobs); the
    sampled tokens' ids are the choice's ``token_ids`` (the top ones' are not given)."""
    if not lp:
        return ()
    tops = lp.get("top_logprobs") or []
    out = []
    for i, (token, logprob) in enumerate(zip(lp["tokens"], lp["token_logprobs"], strict=False)):
        top = tops[i] if i < len(tops) and tops[i] else {}
        ranked = tuple((t, float(v)) for t, v in sorted(top.items(), key=lambda kv: -kv[1]))
        token_id = ids[i] if i < len(ids) else None
        out.append(TokenLogprob(token, float(logprob), ranked, token_id=token_id))
    return tuple(out)


def _content_logprobs(lp: dict[str, Any] | None, ids: Sequence[int]) -> tuple[TokenLogprob, ...]:
    """The generate route's text-mode ``logprobs`` (chat-shaped: ``content``, one entry a
    token with its ``top_logprobs`` list, the sampled token first); the sampled tokens'
    ids are the choice's ``token_ids``."""
    if not lp or not lp.get("content"):
        return ()
    out = []
    for i, e in enumerate(lp["content"]):
        ranked = sorted(e.get("top_logprobs") or [], key=lambda t: -float(t["logprob"]))
        out.append(
            TokenLogprob(
                e.get("token") or "",
                float(e.get("logprob", LOGPROB_FLOOR)),
                tuple((t.get("token") or "", float(t["logprob"])) for t in ranked),
                token_id=ids[i] if i < len(ids) else None,
            )
        )
    return tuple(out)


def prompt_logprobs(
    steps: list[dict[str, Any] | None] | None, ids: Sequence[int], top: int
) -> tuple[TokenLogprob | None, ...] | None:
    """vLLM's ``prompt_logprobs`` (per prompt token: None, or {id: {logprob, rank,
    decoded_token}}; both routes give this shape) as the engine's entries."""
    if steps is None:
        return None
    out: list[TokenLogprob | None] = []
    for token_id, step in zip(ids, steps, strict=False):
        if step is None:
            out.append(None)
            continue
        chosen = step.get(str(token_id)) or {}
        ranked = sorted(step.items(), key=lambda kv: kv[1].get("rank") or 0)[:top]
        out.append(
            TokenLogprob(
                token=chosen.get("decoded_token") or "",
                logprob=float(chosen.get("logprob", LOGPROB_FLOOR)),
                top=tuple((e.get("decoded_token") or "", float(e["logprob"])) for _, e in ranked),
                token_id=token_id,
                top_ids=tuple(int(i) for i, _ in ranked),
                rank=chosen.get("rank"),
            )
        )
    return tuple(out)
