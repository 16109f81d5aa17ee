"""``/tokenize`` and ``/detokenize`` as vLLM's server offers them, through the request
path's own tokenization: a chat request's messages (and tools) render through the same
template, from the same parts the session log keeps, as ``/v1/chat/completions`` sends
them; a prompt as ``/v1/completions`` sends it.  With exact spans on, the answer also
carries the block hashes the index keys those tokens by (the caller's tenant salt).

On a local vision-language model, messages with images are taken in as a chat's are
(decoded, bounded, stored: a bad image is a 400 naming its part) and counted as the
chat counts them, each image expanded to vLLM's placeholders; their blocks' hashes carry
the images' ``("mm", ...)`` keys."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from gateway.core.schemas import ChatCompletionRequest, ChatMessage, RequestModel, ToolSpec
from gateway.core.types import Principal, tenant_salt
from gateway.service.chat import GatewayService
from manifest.hashing import MMSpan


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolSpec] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.tools and self.messages is None:
            raise ValueError("tools are rendered with messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    block_hashes: list[str] | None = None  # vcache: the full blocks' hashes, as indexed


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)


class DetokenizeResponse(BaseModel):
    prompt: str


def _shaping(req: TokenizeRequest) -> dict[str, Any]:
    """The chat prompt shaping asked for, as a chat request's ``template()`` has it."""
    out: dict[str, Any] = {}
    if not req.add_generation_prompt:
        out["add_generation_prompt"] = False
    if req.add_special_tokens:
        out["add_special_tokens"] = True
    return out


async def tokenize(svc: GatewayService, req: TokenizeRequest, who: Principal) -> TokenizeResponse:
    """The ids the request path would send; ``add_special_tokens`` defaults as vLLM's:
    on for a prompt (as text completions tokenize it), off for messages."""
    svc.check_model(req.model or svc.model_name)
    local = svc.local
    spans: tuple[MMSpan, ...] = ()
    chat = _image_chat(req, req.model or svc.model_name) if local.sees else None
    if chat is not None:
        await svc.loop.intake.take(chat)
        ids, spans = await local.chat_prompt(chat)
    elif req.messages is not None:
        tools: list[dict[str, Any]] | None = (
            [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        )
        ids = await local.chat_tokens(req.messages, tools, _shaping(req))
    else:
        special = req.add_special_tokens is not False
        ids = await local.text_tokens(req.prompt or "", add_special_tokens=special)
    tok = local.engine.tokenizer
    kv = svc.dispatcher.kv
    return TokenizeResponse(
        count=len(ids),
        max_model_len=local.engine.capabilities.max_model_len,
        tokens=ids,
        token_strs=[tok.decode([t]) for t in ids] if req.return_token_strs else None,
        block_hashes=[h.hex() for h in kv.hashes(ids, tenant_salt(who.tenant), None, spans)]
        if kv
        else None,
    )


def _image_chat(req: TokenizeRequest, model: str) -> ChatCompletionRequest | None:
    """``req``'s messages as the chat request they render as, when they carry an image or
    a document (None: text only, or a prompt)."""
    if req.messages is None:
        return None
    chat = ChatCompletionRequest(
        model=model,
        messages=req.messages,
        tools=req.tools,
        add_generation_prompt=req.add_generation_prompt,
        add_special_tokens=bool(req.add_special_tokens),
    )
    return chat if any(chat.attachment_parts()) else None


def detokenize(svc: GatewayService, req: DetokenizeRequest) -> DetokenizeResponse:
    svc.check_model(req.model or svc.model_name)
    ids = svc.check_token_ids(list(req.tokens), "tokens")
    return DetokenizeResponse(prompt=svc.local.engine.tokenizer.decode(ids))
