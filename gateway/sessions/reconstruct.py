"""Rebuild what was sent from the session log: the bytes of a provider request, or the
token ids, cache salt and sampling handed to vLLM (as canonical JSON).

The live paths render through the same functions (``provider_call`` and the
adapters; the model's chat template), so a rebuilt request differs from the
sent one only when the log or a renderer is wrong — which the verifier turns
into a refused request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from engines.providers.base import Adapter, CacheDirectives
from engines.tokenizer import ChatTokenizer
from gateway.service.provider_chat import provider_call
from manifest.canonical import canonical_json
from manifest.sessionlog import DispatchEvent, Header, MessageEvent, State


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def local_messages(header: Header, turns: Sequence[MessageEvent]) -> list[dict[str, str]]:
    """The chat-template input: leading system prompts, then the turns (developer → system)."""
    out = [{"role": "system", "content": s} for s in header.system]
    out += [
        {"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in turns
    ]
    return out


def vllm_payload(token_ids: Sequence[int], cache_salt: str | None, sampling: Any) -> bytes:
    """What the gateway hands vLLM, as bytes: token ids, cache salt, resolved sampling."""
    return canonical_json(
        {"prompt_token_ids": list(token_ids), "cache_salt": cache_salt, "sampling": sampling}
    )


class Reconstructor:
    def __init__(
        self,
        adapters: Callable[[str], Adapter],
        tokenizer: Callable[[], ChatTokenizer | None],
    ) -> None:
        self._adapters = adapters
        self._tokenizer = tokenizer

    def rebuild(self, state: State, dispatch: DispatchEvent) -> bytes:
        """The request ``dispatch`` sent, from the state the log folds to just before it."""
        if state.header is None:
            raise ValueError("no header snapshot before the dispatch")
        d = dispatch.settings()
        if dispatch.render == "vllm":
            tok = self._tokenizer()
            if tok is None:
                raise ValueError("no local tokenizer to rebuild a vLLM request with")
            ids = tok.render_chat(local_messages(state.header, state.messages))
            return vllm_payload(ids, d.get("cache_salt"), d.get("sampling"))
        call, _ = provider_call(state.header, state.messages)
        directives = CacheDirectives(
            breakpoints=tuple(d.get("breakpoints") or ()),
            ttl_s=int(d.get("ttl_s", 300)),
            cache_key=d.get("cache_key"),
            cached_content=d.get("cached_content"),
            warm=bool(d.get("warm", False)),
        )
        provider = dispatch.target.partition("/")[0]
        return self._adapters(provider).render(call, directives).body
