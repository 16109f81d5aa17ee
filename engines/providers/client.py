"""One HTTP client per provider: send a rendered request, retry what may be retried.

The transport is a seam (:mod:`engines.providers.transport`): an ``aiohttp``
session by default, an ASGI app in-process where one is given (the emulator
in tests).

Retries (``RetryPolicy``) cover HTTP 408/409/429/5xx/529 and transport
errors, before any text reached the caller.  A stream that breaks after its
first delta raises :class:`ProviderStreamCut` instead: the caller already
holds part of an answer, so only it may decide what to do.  The API key goes
into headers only; it is never logged or put in an error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from engines.providers.base import Adapter, Answer, Delta, Rendered, error_message
from engines.providers.errors import (
    PARSE_ERRORS,
    ProviderBadAnswer,
    ProviderError,
    ProviderStreamCut,
    ProviderTimeout,
    ProviderUnavailable,
    from_status,
)
from engines.providers.ratelimits import RateLimits, parse_ratelimits
from engines.providers.retry import RetryPolicy, parse_retry_after
from engines.providers.transport import (
    AiohttpTransport,
    Response,
    Transport,
    TransportError,
)
from engines.sse import SSEDecoder

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


class ProviderClient:
    def __init__(
        self,
        adapter: Adapter,
        base_url: str,
        api_key: str,
        retry: RetryPolicy | None = None,
        timeout_s: float = 60.0,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.adapter = adapter
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._base = base_url.rstrip("/")
        self._headers = {"content-type": "application/json", **adapter.auth_headers(api_key)}
        self._own = transport is None  # closed with the client (a given one: its giver's)
        self._transport: Transport = transport or AiohttpTransport(timeout_s)
        self.retries = 0
        self.waits: list[float] = []  # each backoff, in seconds (the last 64)
        self.limits: RateLimits | None = None  # the headroom the last response reported
        self.limits_at = 0.0  # when (wall clock): another gateway's newer report wins

    def _post(self, r: Rendered) -> contextlib.AbstractAsyncContextManager[Response]:
        return self._transport.request("POST", self._base + r.path, self._headers, r.body)

    def _saw(self, resp: Response) -> None:
        seen = parse_ratelimits(resp.headers)
        if seen is not None:
            self.limits, self.limits_at = seen, time.time()

    @property
    def provider(self) -> str:
        return self.adapter.provider

    async def aclose(self) -> None:
        if self._own:
            await self._transport.aclose()

    def _error(self, status: int, headers: Mapping[str, str], raw: bytes) -> ProviderError:
        try:
            message = error_message(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError):
            message = raw[:200].decode(errors="replace")
        return from_status(self.provider, status, message, parse_retry_after(headers))

    def _unreached(self, exc: TransportError) -> ProviderError:
        if exc.timeout:
            return ProviderTimeout(self.provider, f"timed out ({exc})")
        return ProviderUnavailable(self.provider, f"transport error ({exc})")

    async def _backoff(self, attempt: int, err: ProviderError) -> None:
        """Sleep before the next attempt, or raise ``err`` when it may not be retried."""
        delay = self._retry.delay(attempt, err.retry_after_s, self._rng) if err.retryable else None
        if delay is None:
            raise err
        self.retries += 1
        self.waits = [*self.waits[-63:], delay]
        log.info("%s: %s; retry %d in %.2fs", self.provider, err, attempt + 1, delay)
        await self._sleep(delay)

    async def send(self, r: Rendered) -> Any:
        """POST ``r`` and return the decoded JSON answer."""
        attempt = 0
        while True:
            try:
                async with self._post(r) as resp:
                    self._saw(resp)
                    raw = await resp.read()
                if resp.status < 400:
                    return json.loads(raw)
                err = self._error(resp.status, resp.headers, raw)
            except TransportError as exc:
                err = self._unreached(exc)
            except (json.JSONDecodeError, UnicodeDecodeError):
                err = ProviderUnavailable(self.provider, "the answer was not JSON")
            await self._backoff(attempt, err)
            attempt += 1

    async def complete(self, r: Rendered) -> Answer:
        """POST ``r`` and parse the answer (a body of the wrong shape is a bad answer)."""
        body = await self.send(r)
        try:
            return self.adapter.parse(body)
        except PARSE_ERRORS as exc:
            raise self._bad_answer(exc) from exc

    def _bad_answer(self, exc: Exception) -> ProviderBadAnswer:
        log.warning("%s: unreadable answer (%s: %s)", self.provider, type(exc).__name__, exc)
        return ProviderBadAnswer(self.provider, "the provider's answer could not be read")

    async def delete(self, path: str) -> None:
        try:
            async with self._transport.request("DELETE", self._base + path, self._headers) as resp:
                raw = await resp.read()
        except TransportError as exc:
            raise self._unreached(exc) from exc
        if resp.status >= 400 and resp.status != 404:
            raise self._error(resp.status, resp.headers, raw)

    async def stream(self, r: Rendered) -> AsyncGenerator[Delta, None]:
        """Stream deltas; retried only until the first delta has been yielded."""
        attempt = 0
        while True:
            started = finished = False
            try:
                async with self._post(r) as resp:
                    self._saw(resp)
                    if resp.status >= 400:
                        err = self._error(resp.status, resp.headers, await resp.read())
                    else:
                        decoder = SSEDecoder()
                        parser = self.adapter.stream_parser()
                        async for raw in resp.chunks():
                            for event in decoder.feed(raw):
                                try:
                                    deltas = parser.feed(event)
                                except PARSE_ERRORS as exc:
                                    raise self._bad_answer(exc) from exc
                                for delta in deltas:
                                    started = True
                                    finished = finished or delta.finish_reason is not None
                                    yield delta
                        if not finished:
                            raise ProviderStreamCut(
                                self.provider, "the stream ended before the answer"
                            )
                        return
            except TransportError as exc:
                if started:
                    raise ProviderStreamCut(
                        self.provider, f"the stream broke mid-answer ({exc})"
                    ) from exc
                err = self._unreached(exc)
            except ProviderError as exc:
                if started or not exc.retryable:
                    raise
                err = exc
            await self._backoff(attempt, err)
            attempt += 1
