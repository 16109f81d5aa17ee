"""A remote vLLM replica: ``python -m vllm.entrypoints.openai.api_server`` on another host or port.

The gateway still tokenizes (with the same model's tokenizer) and sends token
ids to the replica's ``/v1/completions`` with the tenant's ``cache_salt``, so
the block hashes it computes are the replica's.  The replica must run with
the vcache plugins (``VLLM_PLUGINS=vcache,vcache-control``,
``VCACHE_CONTROL_SECRET``), ``--enable-prefix-caching
--prefix-caching-hash-algo sha256_cbor``, ``--enable-prompt-tokens-details``,
KV events on ZMQ, and the gateway's ``PYTHONHASHSEED``.

Closing a stream closes the HTTP response, and vLLM aborts a request whose
client went away.  HTTP and transport errors map onto ``engines.errors``.  The
transport is an ``aiohttp`` session, made in the engine's event loop on first use:
every token of every request is relayed through it, and ``httpx`` spent about
twice its CPU per streamed chunk (measured with ``loadtests/bench_workers.py``).
Idle connections are dropped before the replica's keep-alive ends, and a request
whose pooled connection turns out closed before any answer is sent again once,
on a new connection (the replica never read it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from engines.base import (
    LOGPROB_FLOOR,
    EngineCapabilities,
    EngineStats,
    GenerateChunk,
    GenerateRequest,
    SamplingOptions,
    TokenLogprob,
)
from engines.errors import (
    EngineError,
    EngineGenerationFailed,
    EngineInputError,
    EngineOverloaded,
    EngineUnavailable,
)
from engines.sse import SSEDecoder
from engines.tokenizer import ChatTokenizer
from engines.vllm.control import CONTROL_PATH, SECRET_HEADER, from_wire, to_wire


@dataclass(frozen=True)
class RemoteVllmConfig:
    url: str  # e.g. http://10.0.0.7:8000
    tokenizer: str  # the model's path or hub id, for the gateway's own tokenizer
    control_secret: str
    served_model_name: str | None = None  # None: the replica's first model
    api_key: str | None = None
    hash_seed: str = "0"
    timeout_s: float = 600.0
    # How long an idle connection is kept for reuse: shorter than the replica's own
    # keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), or a request may be
    # written to a connection the replica is closing.
    keepalive_s: float = 4.0


def _error(status: int, body: bytes) -> EngineError:
    try:
        message = json.loads(body).get("error", {}).get("message") or body.decode()
    except (ValueError, AttributeError):
        message = body.decode(errors="replace")
    if status in (429, 503):
        return EngineOverloaded(f"replica busy: {message}")
    if 400 <= status < 500:
        return EngineInputError(message)
    return EngineGenerationFailed(f"replica error {status}: {message}")


class RemoteVllmEngine:
    def __init__(self, config: RemoteVllmConfig) -> None:
        self._config = config
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=min(config.timeout_s, 10.0), sock_read=config.timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self._tokenizer: ChatTokenizer | None = None
        self._caps: EngineCapabilities | None = None
        self._model = config.served_model_name or ""
        self._running = 0
        self._closed = False
        self.stale_retries = 0  # requests sent again after a pooled connection closed

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                base_url=self._config.url,
                headers=self._headers,
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                connector=aiohttp.TCPConnector(keepalive_timeout=self._config.keepalive_s),
            )
        return self._session

    async def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        """POST ``body``; once more on a new connection if the pooled one was closed under
        it before an answer came (a refused connection is not retried: the replica is down)."""
        try:
            return await self._http().post(path, json=body, headers=headers)
        except aiohttp.ClientConnectorError:
            raise
        except (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
            aiohttp.ClientConnectionResetError,
        ):
            self.stale_retries += 1
            return await self._http().post(path, json=body, headers=headers)

    @property
    def capabilities(self) -> EngineCapabilities:
        if self._caps is None:
            raise EngineUnavailable("replica not started")
        return self._caps

    @property
    def tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            raise EngineUnavailable("replica not started")
        return self._tokenizer

    @property
    def ready(self) -> bool:
        return self._caps is not None and not self._closed

    async def start(self) -> None:
        try:
            async with self._http().get("/v1/models") as r:
                r.raise_for_status()
                models = (await r.json())["data"]
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            raise EngineUnavailable(f"replica {self._config.url} unreachable: {exc}") from exc
        card = next((m for m in models if m["id"] == self._model), models[0])
        self._model = card["id"]
        stats = await self.call_core("vcache_cache_stats")
        # off the event loop: loading blocks for seconds, and the loop keeps serving
        self._tokenizer = await asyncio.to_thread(
            ChatTokenizer.from_pretrained, self._config.tokenizer
        )
        self._caps = EngineCapabilities(
            name="vllm-remote",
            max_model_len=int(card.get("max_model_len") or 0),
            block_size=int(stats["block_size"]),
            exact_prefix_cache=True,
            hash_algo="sha256_cbor",
            hash_seed=self._config.hash_seed,
            span_control=True,
            model=str(card.get("root") or self._config.tokenizer),
        )

    def stats(self) -> EngineStats:
        return EngineStats(unfinished_requests=self._running)

    async def call_core(self, method: str, *args: Any) -> Any:
        """Run an engine-core plugin method through the replica's control endpoint."""
        try:
            async with await self._post(
                CONTROL_PATH.format(method=method),
                {"args": to_wire(list(args))},
                {SECRET_HEADER: self._config.control_secret},
            ) as r:
                if r.status != 200:
                    text = await r.text()
                    raise EngineUnavailable(f"control endpoint refused {method}: {r.status} {text}")
                return from_wire((await r.json())["result"])
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"control endpoint unreachable: {exc!r}") from exc

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        if not self.ready:
            raise EngineUnavailable("replica is not ready")
        s = request.sampling
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "ignore_eos": s.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "request_id": request.request_id,
        }
        if s.n > 1:
            body["n"] = s.n
        if s.top_k:
            body["top_k"] = s.top_k
        if s.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in s.logit_bias}
        if s.logprobs is not None:
            body["logprobs"] = s.logprobs
        if s.prompt_logprobs is not None:  # vLLM gives them only to a whole answer
            body.update(prompt_logprobs=s.prompt_logprobs, stream=False)
            del body["stream_options"]
        body.update(_extensions(s))
        if s.structured is not None:
            body["structured_outputs"] = s.structured.vllm()
        if s.stop:
            body["stop"] = list(s.stop)
        if s.seed is not None:
            body["seed"] = s.seed
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        if request.priority:
            body["priority"] = request.priority
        self._running += 1
        try:
            async with await self._post("/v1/completions", body) as resp:
                if resp.status != 200:
                    raise _error(resp.status, await resp.read())
                read = self._chunks if body["stream"] else self._whole
                async with aclosing(read(resp, request)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                    return
        except TimeoutError as exc:
            raise EngineUnavailable(f"replica timed out: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"replica connection failed: {exc!r}") from exc
        finally:
            self._running -= 1

    async def _whole(
        self, resp: aiohttp.ClientResponse, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        """A whole (non-streamed) answer as the chunks a stream would have given."""
        data = json.loads(await resp.read())
        top = request.sampling.prompt_logprobs or 0
        for c in data.get("choices") or []:
            chunk = _choice_chunk(c, request.num_prompt_tokens)
            lps = _prompt_logprobs(c.get("prompt_logprobs"), request.prompt_token_ids, top)
            yield replace(chunk, prompt_logprobs=lps)
        yield _usage_chunk(data.get("usage") or {}, request.num_prompt_tokens)

    async def _chunks(
        self, resp: aiohttp.ClientResponse, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        num_prompt = request.num_prompt_tokens
        decoder = SSEDecoder()
        async for raw in resp.content.iter_any():
            for event in decoder.feed(raw):
                if event.data == "[DONE]":
                    return
                data = json.loads(event.data)
                if "error" in data:
                    raise _error(int(data["error"].get("code") or 500), event.data.encode())
                usage = data.get("usage")
                if data.get("choices"):
                    for c in data["choices"]:
                        yield _choice_chunk(c, num_prompt)
                elif usage is not None:
                    yield _usage_chunk(usage, num_prompt)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._session is not None:
                await self._session.close()


def _extensions(s: SamplingOptions) -> dict[str, Any]:
    """vLLM's sampling extensions the request sets (the replica's defaults otherwise)."""
    out: dict[str, Any] = {}
    if s.min_p:
        out["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        out["repetition_penalty"] = s.repetition_penalty
    if s.min_tokens:
        out["min_tokens"] = s.min_tokens
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.include_stop_str_in_output:
        out["include_stop_str_in_output"] = True
    if not s.skip_special_tokens:
        out["skip_special_tokens"] = False
    if not s.spaces_between_special_tokens:
        out["spaces_between_special_tokens"] = False
    if s.bad_words:
        out["bad_words"] = list(s.bad_words)
    if s.allowed_token_ids is not None:
        out["allowed_token_ids"] = list(s.allowed_token_ids)
    return out


def _stop_string(reason: Any) -> str | None:
    """vLLM's ``stop_reason`` extension: the stop string that matched (an int is a token)."""
    return reason if isinstance(reason, str) else None


def _choice_chunk(c: dict[str, Any], num_prompt: int) -> GenerateChunk:
    """A completions-API choice (a stream's or a whole answer's) as an engine chunk."""
    ids = tuple(c.get("token_ids") or ())
    return GenerateChunk(
        text=c.get("text") or "",
        token_ids=ids,
        num_prompt_tokens=num_prompt,
        num_cached_tokens=None,  # reported with the final usage
        finish_reason=c.get("finish_reason"),
        index=int(c.get("index") or 0),
        logprobs=_logprobs(c.get("logprobs"), ids),
        stop_sequence=_stop_string(c.get("stop_reason")),
    )


def _usage_chunk(usage: dict[str, Any], num_prompt: int) -> GenerateChunk:
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


def _prompt_logprobs(
    steps: list[dict[str, Any] | None] | None, ids: Sequence[int], top: int
) -> tuple[TokenLogprob | None, ...] | None:
    """vLLM's ``prompt_logprobs`` (per prompt token: None, or {id: {logprob, rank,
    decoded_token}}) as the engine's entries."""
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
