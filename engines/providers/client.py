"""One HTTP client per provider: send a rendered request, retry what may be retried.

Retries (``RetryPolicy``) cover HTTP 408/409/429/5xx/529 and transport
errors, before any text reached the caller.  A stream that breaks after its
first delta raises :class:`ProviderStreamCut` instead: the caller already
holds part of an answer, so only it may decide what to do.  The API key goes
into headers only; it is never logged or put in an error message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import httpx

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
    ) -> None:
        self.adapter = adapter
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._rng = rng or random.Random()
        headers = {"content-type": "application/json", **adapter.auth_headers(api_key)}
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout
        )
        self.retries = 0
        self.waits: list[float] = []  # each backoff, in seconds (the last 64)
        self.limits: RateLimits | None = None  # the headroom the last response reported
        self.rate_limited = 0  # 429s received (retried or not)

    def _saw(self, resp: httpx.Response) -> None:
        self.limits = parse_ratelimits(resp.headers) or self.limits
        if resp.status_code == 429:
            self.rate_limited += 1

    @property
    def provider(self) -> str:
        return self.adapter.provider

    async def aclose(self) -> None:
        await self._http.aclose()

    def _error(self, resp: httpx.Response) -> ProviderError:
        try:
            message = error_message(resp.json())
        except (json.JSONDecodeError, UnicodeDecodeError):
            message = resp.text[:200]
        after = parse_retry_after(resp.headers)
        return from_status(self.provider, resp.status_code, message, after)

    def _transport(self, exc: httpx.HTTPError) -> ProviderError:
        if isinstance(exc, httpx.TimeoutException):
            return ProviderTimeout(self.provider, f"timed out ({type(exc).__name__})")
        return ProviderUnavailable(self.provider, f"transport error ({type(exc).__name__})")

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
                resp = await self._http.post(r.path, content=r.body)
                self._saw(resp)
                if resp.status_code < 400:
                    return resp.json()
                err = self._error(resp)
            except httpx.HTTPError as exc:
                err = self._transport(exc)
            except json.JSONDecodeError:
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
            resp = await self._http.delete(path)
        except httpx.HTTPError as exc:
            raise self._transport(exc) from exc
        if resp.status_code >= 400 and resp.status_code != 404:
            raise self._error(resp)

    async def stream(self, r: Rendered) -> AsyncGenerator[Delta, None]:
        """Stream deltas; retried only until the first delta has been yielded."""
        attempt = 0
        while True:
            started = finished = False
            try:
                async with self._http.stream("POST", r.path, content=r.body) as resp:
                    self._saw(resp)
                    if resp.status_code >= 400:
                        await resp.aread()
                        err = self._error(resp)
                    else:
                        decoder = SSEDecoder()
                        parser = self.adapter.stream_parser()
                        async for raw in resp.aiter_bytes():
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
            except httpx.HTTPError as exc:
                if started:
                    raise ProviderStreamCut(
                        self.provider, f"the stream broke mid-answer ({type(exc).__name__})"
                    ) from exc
                err = self._transport(exc)
            except ProviderError as exc:
                if started or not exc.retryable:
                    raise
                err = exc
            await self._backoff(attempt, err)
            attempt += 1
