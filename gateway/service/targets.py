"""Model aliases: ordered targets, which goes first, and when a request moves on.

A client's ``model`` names the local model, an alias from config (for
example ``[local, anthropic/claude-sonnet-4-5]``), or ``provider/model`` for
a configured provider.  Of an alias's targets the cheapest for the prompt
goes first (:func:`by_cost`; ``routing.by: order`` keeps the alias order).  A
request moves to the next target when the current one is unavailable or
overloaded, the prompt exceeds its context, or a provider still fails after
its retries; never for the client's own mistakes, and a streamed answer only
before its first token.

A call that carries images or documents goes only to targets that see
(:func:`sees`: the local model when it is a vision-language model; a provider as
its spec says, so not DeepSeek): the others are neither quoted nor tried, and a call no
target of its model can see is a 400 naming the first image
(:func:`seeing`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engines.providers import specs
from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import APIError, InvalidRequest, NotFound, RateLimited, Unavailable
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.target import Call, Quote


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

    @property
    def local(self) -> str | None:
        """The local model's served name (None: hosted providers only)."""
        return self._local

    def names(self) -> list[str]:
        return [*([self._local] if self._local is not None else []), *self._aliases]


def can_fall_back(exc: APIError) -> bool:
    if isinstance(exc, InvalidRequest):  # what this target cannot do, another may
        return exc.code in ("context_length_exceeded", "tools_unsupported", "unsupported_on_target")
    return isinstance(exc, Unavailable | RateLimited) or exc.status >= 500


def by_cost(names: Sequence[str], quotes: Sequence[Quote[Any]], margin: float) -> list[str]:
    """``names`` (in alias order) ordered by their quotes' price per prompt token: each
    place goes to the earliest target left whose rate, less ``margin`` of it, is at most
    the cheapest one's.  A later target moves ahead only when it is clearly cheaper (a
    belief's probability is an estimate), and equal rates keep the alias order."""
    left = list(range(len(names)))
    order: list[str] = []
    while left:
        low = min(quotes[i].rate for i in left)
        pick = next(i for i in left if quotes[i].rate * (1 - margin) <= low)
        order.append(names[pick])
        left.remove(pick)
    return order


def sees(name: str, local: bool = False) -> bool:
    """Whether target ``name`` takes images and documents: the local model when it is a
    vision-language model (``local``: :attr:`LocalChat.sees
    <gateway.service.local.LocalChat.sees>`, images only: a document part is its 400); a
    provider as its spec says."""
    if name == LOCAL_TARGET:
        return local
    provider = name.partition("/")[0]
    return provider in specs.PROVIDERS and specs.sees(provider)


def shown(call: Call) -> str | None:
    """The name of the first image or document ``call`` carries (None: text only)."""
    req = call.request
    if not isinstance(req, ChatCompletionRequest):
        return None
    return next((where for where, _ in req.attachment_parts()), None)


def seeing(names: Sequence[str], call: Call, can_see: Callable[[str], bool] = sees) -> list[str]:
    """Of ``names``, those that can serve ``call``: all of them for a text-only call; for
    one with images or documents, those that see (a 400 naming the first when none)."""
    where = shown(call)
    if where is None:
        return list(names)
    kept = [n for n in names if can_see(n)]
    if kept:
        return kept
    blind = ", ".join("the local model" if n == LOCAL_TARGET else n for n in names)
    raise InvalidRequest(
        f"{where}: images and documents are not supported by {blind} (the targets of "
        f"'{call.request.model}')",
        param=where,
        code="unsupported_on_target",
    )
