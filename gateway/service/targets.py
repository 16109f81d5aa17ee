"""Model aliases: ordered targets, and when a request moves on to the next one.

A client's ``model`` names the local model, an alias from config (for
example ``[local, anthropic/claude-sonnet-4-5]``), or ``provider/model`` for
a configured provider.  A request moves to the next target when the current
one is unavailable or overloaded, the prompt exceeds its context, or a
provider still fails after its retries; never for the client's own mistakes,
and a streamed answer only before its first token.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import APIError, InvalidRequest, NotFound, RateLimited, Unavailable
from gateway.core.metrics import Metrics
from gateway.core.types import Served

log = logging.getLogger(__name__)

T = TypeVar("T")


class Targets:
    def __init__(
        self,
        local_model: str | None,
        aliases: Mapping[str, Sequence[str]],
        providers: Sequence[str],
    ) -> None:
        self._local = local_model
        self._aliases = {k: list(v) for k, v in aliases.items()}
        self._providers = set(providers)

    def resolve(self, model: str) -> list[str]:
        if self._local is not None and model == self._local:
            return [LOCAL_TARGET]
        if model in self._aliases:
            return list(self._aliases[model])
        provider, sep, rest = model.partition("/")
        if sep and rest and provider in self._providers:
            return [model]
        raise NotFound(f"The model '{model}' does not exist", param="model", code="model_not_found")

    def names(self) -> list[str]:
        return [*([self._local] if self._local is not None else []), *self._aliases]


def can_fall_back(exc: APIError) -> bool:
    if isinstance(exc, InvalidRequest):  # what this target cannot do, another may
        return exc.code in ("context_length_exceeded", "tools_unsupported", "unsupported_on_target")
    return isinstance(exc, Unavailable | RateLimited) or exc.status >= 500


async def first_ok(
    targets: Sequence[str],
    attempt: Callable[[str], Awaitable[T]],
    served: Served,
    metrics: Metrics,
) -> T:
    """``attempt(target)`` for each target in order until one succeeds."""
    for i, target in enumerate(targets):
        try:
            return await attempt(target)
        except APIError as exc:
            if i == len(targets) - 1 or not can_fall_back(exc):
                raise
            reason = exc.code or exc.type
            log.warning("%s failed (%s: %s); trying %s", target, reason, exc, targets[i + 1])
            metrics.fallbacks.labels(target, reason).inc()
            served.fallback_from += (target,)
    raise AssertionError("no targets")  # resolve() never returns an empty list
