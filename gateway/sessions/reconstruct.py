"""Rebuild what was sent from the session log: the bytes of a provider request, or the
token ids, cache salt and sampling handed to vLLM (as canonical JSON): a chat's
ids through the model's chat template, a text completion's prompt (a dispatch
with a ``prompt`` directive) tokenized or as given.

The live paths render through the same functions (``provider_call`` and the
adapters; the model's chat template), so a rebuilt request differs from the
sent one only when the log or a renderer is wrong — which the verifier turns
into a refused request.  An image or a document a logged message references is
read back from the attachments store, verified against the reference (digest,
size, media type, pixel size): a missing or corrupt object raises
:class:`~manifest.attachments.AttachmentMismatch` naming its digest, and nothing
is rebuilt from other bytes.  A request run under a LoRA adapter is rebuilt with the
adapter its header snapshot records (name, path, sha256 of the weights); when the
weights read now (``weights``) are not those, or are gone, it is not rebuilt:
:class:`AdapterChanged` names the adapter and what differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from engines.lora import LoraRef
from engines.providers.base import Adapter, CacheDirectives
from engines.tokenizer import ChatTokenizer
from gateway.sessions.render import (
    Attachments,
    chat_prompt,
    local_messages,
    logged_adapter,
    prompt_images,
    provider_call,
    text_prompt,
    vllm_payload,
)
from manifest.sessionlog import DispatchEvent, PartRef, State, entry_prompt

# a vision model's template ids with the logged images expanded (as the live path did)
ExpandImages = Callable[[Sequence[int], Sequence[PartRef], Attachments], list[int]]
# the sha256 of an adapter's weights as they are now (None: gone, or not readable here)
AdapterWeights = Callable[[LoraRef], str | None]


class AdapterChanged(Exception):
    """A logged request's adapter no longer has the weights it ran with (changed since,
    or gone): rebuilt, it would not be the request that was sent."""

    def __init__(self, adapter: LoraRef, now: str | None) -> None:
        self.adapter, self.now = adapter, now
        was = f"sha256 {adapter.sha256}"
        why = (
            f"its weights at {adapter.path} are gone (recorded {was})"
            if now is None
            else f"its weights at {adapter.path} changed since (recorded {was}, now sha256 {now})"
        )
        super().__init__(f"the LoRA adapter '{adapter.name}': {why}")


def check_adapter(adapter: LoraRef, weights: AdapterWeights | None) -> None:
    """Raise :class:`AdapterChanged` when ``adapter``'s recorded weights are not those
    ``weights`` reads now; nothing to check when none were recorded (its files were not
    on the gateway's host) or nothing reads them."""
    if adapter.sha256 is None or weights is None:
        return
    now = weights(adapter)
    if now != adapter.sha256:
        raise AdapterChanged(adapter, now)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Reconstructor:
    def __init__(
        self,
        adapters: Callable[[str], Adapter],
        tokenizer: Callable[[], ChatTokenizer | None],
        expand_images: ExpandImages | None = None,
        weights: AdapterWeights | None = None,
    ) -> None:
        """``expand_images``: where the local model is a vision-language model;
        ``weights``: the digest of a LoRA adapter's weights now (the live gateway's: as
        its engines loaded them; offline: read from disk)."""
        self._adapters = adapters
        self._tokenizer = tokenizer
        self._expand = expand_images
        self._weights = weights

    def rebuild(
        self, state: State, dispatch: DispatchEvent, attachments: Attachments | None = None
    ) -> bytes:
        """The request ``dispatch`` sent, from the state the log folds to just before it
        and the attachment objects it references (``attachments``: the store's verified
        read)."""
        if state.header is None:
            raise ValueError("no header snapshot before the dispatch")
        d = dispatch.settings()
        if dispatch.render == "vllm":
            lora = logged_adapter(state.header)
            if lora is not None:
                check_adapter(lora, self._weights)
            refs = prompt_images(state.messages)
            if refs and (self._expand is None or attachments is None):
                raise ValueError("a local request with images, and no vision model to expand them")
            tok = self._tokenizer()
            if tok is None:
                raise ValueError("no local tokenizer to rebuild a vLLM request with")
            if "prompt" in d:  # a text completion's prompt: the last entry
                if not state.messages:
                    raise ValueError("no prompt before a text completion's dispatch")
                ids = text_prompt(tok, entry_prompt(state.messages[-1]), d["prompt"])
            else:
                tools = state.header.tool_list() or None
                messages = local_messages(state.header.system, state.messages, tools)
                ids = chat_prompt(tok, messages, tools, d.get("template"))
            if refs and self._expand is not None and attachments is not None:
                ids = self._expand(ids, refs, attachments)
            images = [r.ref.digest for r in refs]
            uuids = [r.uuid for r in refs]
            return vllm_payload(ids, d.get("cache_salt"), d.get("sampling"), images, lora, uuids)
        call, _ = provider_call(state.header, state.messages, attachments=attachments)
        directives = CacheDirectives(
            breakpoints=tuple(d.get("breakpoints") or ()),
            ttl_s=int(d.get("ttl_s", 300)),
            long_ttl=tuple(d.get("long_ttl") or ()),
            retention=d.get("retention"),
            cache_key=d.get("cache_key"),
            cached_content=d.get("cached_content"),
            warm=bool(d.get("warm", False)),
        )
        provider = dispatch.target.partition("/")[0]
        return self._adapters(provider).render(call, directives).body
