"""A remote vLLM replica: ``python -m vllm.entrypoints.openai.api_server`` on another host or port.

The gateway still tokenizes (with the same model's tokenizer) and sends token
ids with the tenant's ``cache_salt``, so the block hashes it computes are the
replica's: to vLLM's token-in/token-out route ``/inference/v1/generate`` where
the replica offers it (``--enable-scale-out``), else to ``/v1/completions``
(``engines.vllm.remote_wire``; ``api`` picks one).  The replica must run with
the vcache plugins (``VLLM_PLUGINS=vcache,vcache-control``,
``VCACHE_CONTROL_SECRET``), ``--enable-prefix-caching
--prefix-caching-hash-algo sha256_cbor``, ``--enable-prompt-tokens-details``,
KV events on ZMQ, and the gateway's ``PYTHONHASHSEED``.

Images travel on the generate route only (``remote_wire.content_parts``: the
original bytes under the gateway's identifier as their uuid); a replica reached on
the completions route refuses them by name.  The replica reports the ids it
expanded the images to, and an expansion unlike the gateway's is logged and
counted (``expansion_mismatches``).

Closing a stream closes the HTTP response, and vLLM aborts a request whose
client went away.  HTTP and transport errors map onto ``engines.errors``.  The
transport is an ``aiohttp`` session, made in the engine's event loop on first use:
every token of every request is relayed through it, and ``httpx`` spent about
twice its CPU per streamed chunk (measured with ``python -m loadtests.bench_workers``).
Idle connections are dropped before the replica's keep-alive ends, and a request
whose pooled connection turns out closed before any answer is sent again once,
on a new connection (the replica never read it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, Literal

import aiohttp

from engines.base import EngineCapabilities, EngineStats, GenerateChunk, GenerateRequest
from engines.errors import (
    EngineError,
    EngineGenerationFailed,
    EngineInputError,
    EngineOverloaded,
    EngineUnavailable,
)
from engines.lora import LoraRef
from engines.sse import SSEDecoder
from engines.tokenizer import ChatTokenizer
from engines.vllm.control import CONTROL_PATH, SECRET_HEADER, from_wire, to_wire
from engines.vllm.remote_wire import (
    PATHS,
    RemoteApi,
    choice_chunk,
    expansion,
    expansion_differs,
    prompt_logprobs,
    request_body,
    streamed,
    usage_chunk,
)

log = logging.getLogger(__name__)


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
    # which of vLLM's token-id routes to send to (engines.vllm.remote_wire); auto: the
    # token-in/token-out one where the replica offers it (--enable-scale-out)
    api: Literal["auto", "completions", "generate"] = "auto"


_JSON = {"Content-Type": "application/json"}


def _encoded(api: RemoteApi, request: GenerateRequest, model: str) -> bytes:
    """``request_body`` as the JSON bytes sent."""
    return json.dumps(request_body(api, request, model)).encode()


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
        self.api: RemoteApi = "completions"  # settled by start()
        self.stale_retries = 0  # requests sent again after a pooled connection closed
        # image requests the replica expanded otherwise than the gateway (then its
        # predictions for them are not exact: the replica's processor is configured apart)
        self.expansion_mismatches = 0

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
        self, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        """POST ``body`` (a JSON object, or one encoded already); once more on a new
        connection if the pooled one was closed under it before an answer came (a refused
        connection is not retried: the replica is down)."""
        if isinstance(body, bytes):
            kwargs: dict[str, Any] = {"data": body, "headers": {**_JSON, **(headers or {})}}
        else:
            kwargs = {"json": body, "headers": headers}
        try:
            return await self._http().post(path, **kwargs)
        except aiohttp.ClientConnectorError:
            raise
        except (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
            aiohttp.ClientConnectionResetError,
        ):
            self.stale_retries += 1
            return await self._http().post(path, **kwargs)

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
        self.api = await self._pick_api()
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

    async def _pick_api(self) -> RemoteApi:
        """The route configured, or under ``auto`` the generate route where the replica's
        OpenAPI document lists it (vLLM lists it only with ``--enable-scale-out``)."""
        wanted = self._config.api
        if wanted == "completions":
            return wanted
        try:
            async with self._http().get("/openapi.json") as r:
                offered = PATHS["generate"] in ((await r.json()).get("paths") or {})
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            offered = False
            log.info("replica %s: no OpenAPI document (%r)", self._config.url, exc)
        if wanted == "generate" and not offered:
            raise EngineUnavailable(
                f"replica {self._config.url} does not offer {PATHS['generate']}: start it "
                "with --enable-scale-out, or set its api to completions or auto"
            )
        api: RemoteApi = "generate" if offered else "completions"
        log.info("replica %s: token ids go to %s", self._config.url, PATHS[api])
        return api

    def stats(self) -> EngineStats:
        return EngineStats(
            unfinished_requests=self._running,
            image_expansion_mismatches=self.expansion_mismatches,
        )

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
        if request.images and self.api != "generate":
            # vLLM's completions route takes token ids or images, not both
            raise EngineInputError(
                f"image 1 of {len(request.images)}: replica {self._config.url} takes token "
                f"ids on {PATHS[self.api]}, which takes no images; images need "
                f"{PATHS['generate']} (start the replica with --enable-scale-out)"
            )
        model = request.lora.name if request.lora is not None else self._model
        body: dict[str, Any] | bytes
        if request.images:  # megabytes of base64 (20 MB of image: ~0.3 s): off the loop
            body = await asyncio.to_thread(_encoded, self.api, request, model)
        else:
            body = request_body(self.api, request, model)
        stream = streamed(request)
        self._running += 1
        try:
            async with await self._post(PATHS[self.api], body) as resp:
                if resp.status != 200:
                    raise _error(resp.status, await resp.read())
                read = self._chunks if stream else self._whole
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
        self._check_expansion(request, data)
        top = request.sampling.prompt_logprobs or 0
        steps = data.get("prompt_logprobs")  # the generate route's, beside its choices
        for c in data.get("choices") or []:
            chunk = choice_chunk(self.api, c, request.num_prompt_tokens)
            lps = prompt_logprobs(c.get("prompt_logprobs", steps), request.prompt_token_ids, top)
            yield replace(chunk, prompt_logprobs=lps)
        yield usage_chunk(data.get("usage") or {}, request.num_prompt_tokens)

    def _check_expansion(self, request: GenerateRequest, data: dict[str, Any]) -> bool:
        """Compare the ids and placeholders the replica expanded an image request to (in
        ``data``, its first chunk or whole answer) with the gateway's; a difference is
        logged and counted (the answer stands: only its prediction was not exact).  False
        when ``data`` carries no expansion."""
        if not request.images:
            return True
        found = expansion(data)
        if found is None:
            return False
        differs = expansion_differs(request, *found)
        if differs is not None:
            self.expansion_mismatches += 1
            log.warning(
                "replica %s expanded the images of %s otherwise than the gateway: %s "
                "(its image processor is configured apart?)",
                self._config.url,
                request.request_id,
                differs,
            )
        return True

    async def _chunks(
        self, resp: aiohttp.ClientResponse, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        num_prompt = request.num_prompt_tokens
        decoder = SSEDecoder()
        unchecked = bool(request.images)  # the first chunk carries the replica's expansion
        async for raw in resp.content.iter_any():
            for event in decoder.feed(raw):
                if event.data == "[DONE]":
                    return
                data = json.loads(event.data)
                if "error" in data:
                    raise _error(int(data["error"].get("code") or 500), event.data.encode())
                if unchecked:
                    unchecked = not self._check_expansion(request, data)
                usage = data.get("usage")
                if data.get("choices"):
                    for c in data["choices"]:
                        yield choice_chunk(self.api, c, num_prompt)
                elif usage is not None:
                    yield usage_chunk(usage, num_prompt)

    # ------------------------------------------------------------ LoRA

    @property
    def lora_enabled(self) -> bool:
        """Whether the replica runs with ``--enable-lora`` is its own: a load it refuses
        says why."""
        return True

    async def adapters(self) -> list[LoraRef]:
        """The adapters the replica lists in its ``/v1/models`` (``parent``: the base
        model, ``root``: the adapter's path)."""
        try:
            async with self._http().get("/v1/models") as r:
                r.raise_for_status()
                models = (await r.json())["data"]
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            raise EngineUnavailable(f"replica {self._config.url} unreachable: {exc}") from exc
        return [
            LoraRef(str(m["id"]), str(m.get("root") or m["id"]))
            for m in models
            if m.get("parent") and m["id"] != self._model
        ]

    async def _admin(self, path: str, body: dict[str, str]) -> tuple[int, bytes]:
        try:
            async with await self._post(path, body) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"replica {self._config.url} unreachable: {exc!r}") from exc

    async def load_adapter(self, adapter: LoraRef) -> None:
        """Through the replica's own ``/v1/load_lora_adapter`` (it runs with
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``); a name it holds at another path is
        unloaded first."""
        held = {a.name: a.path for a in await self.adapters()}
        if held.get(adapter.name) == adapter.path:
            return
        if adapter.name in held:
            await self.unload_adapter(adapter.name)
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        status, raw = await self._admin("/v1/load_lora_adapter", body)
        if status != 200:
            err = _error(status, raw)
            if isinstance(err, EngineInputError):
                raise EngineInputError(
                    f"adapter '{adapter.name}' could not be loaded from {adapter.path}: {err}",
                    param="lora_path",
                )
            raise err

    async def unload_adapter(self, name: str) -> bool:
        status, raw = await self._admin("/v1/unload_lora_adapter", {"lora_name": name})
        if status == 200:
            return True
        if status in (400, 404):  # vLLM: not loaded
            return False
        raise _error(status, raw)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._session is not None:
                await self._session.close()
