"""One typed hierarchy for every provider failure, also mid-stream::

EngineError
└── ProviderError            (provider, status, retry_after_s)
    ├── ProviderBadRequest   400/413/422: the request itself; never retried
    ├── ProviderAuthError    401/403: the gateway's key for it
    ├── ProviderNotFound     404: a model or a cached-content handle
    ├── ProviderRateLimited  429 (retry-after honoured)
    ├── ProviderOverloaded   529, 503
    └── ProviderUnavailable  other 5xx, 409, transport errors, a stream cut mid-way
        ├── ProviderTimeout  408, connect/read timeouts
        └── ProviderBadAnswer  a 2xx answer (or stream event) that does not parse
"""

from __future__ import annotations

from engines.errors import EngineError


class ProviderError(EngineError):
    retryable = False

    def __init__(
        self,
        provider: str,
        message: str,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{provider}: {message}")
        self.provider = provider
        self.status = status
        self.retry_after_s = retry_after_s


class ProviderBadRequest(ProviderError):
    pass


class ProviderAuthError(ProviderError):
    pass


class ProviderNotFound(ProviderError):
    pass


class ProviderRateLimited(ProviderError):
    retryable = True


class ProviderOverloaded(ProviderError):
    retryable = True


class ProviderUnavailable(ProviderError):
    retryable = True


class ProviderTimeout(ProviderUnavailable):
    pass


class ProviderStreamCut(ProviderUnavailable):
    """The connection ended in the middle of a streamed answer (not retried: text was sent)."""

    retryable = False


def from_status(
    provider: str, status: int, message: str, retry_after_s: float | None = None
) -> ProviderError:
    kind: type[ProviderError]
    if status in (401, 403):
        kind = ProviderAuthError
    elif status == 404:
        kind = ProviderNotFound
    elif status == 408:
        kind = ProviderTimeout
    elif status == 429:
        kind = ProviderRateLimited
    elif status in (503, 529):
        kind = ProviderOverloaded
    elif status == 409 or status >= 500:
        kind = ProviderUnavailable
    else:
        kind = ProviderBadRequest
    return kind(provider, f"HTTP {status}: {message}", status, retry_after_s)


class ProviderBadAnswer(ProviderUnavailable):
    """The provider answered 2xx with a body its adapter cannot read: not the client's
    fault; a 502, and an alias falls back.  Not retried: the same bytes would come back."""

    retryable = False


# What an adapter's parser raises on an answer of the wrong shape.
PARSE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError)
