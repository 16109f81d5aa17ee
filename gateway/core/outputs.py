"""Typed OpenAI answer models: chat completions (whole and chunks), text completions,
usage, logprobs, models.  They allow extra fields and are never built as raw dicts."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    computed_field,
    model_serializer,
)


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Out):
    cached_tokens: int = 0
    cache_write_tokens: int | None = None  # providers that charge for cache writes

    @model_serializer(mode="wrap")
    def _omit_unset_writes(self, nxt: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = nxt(self)
        if out.get("cache_write_tokens") is None:
            out.pop("cache_write_tokens", None)
        return out


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int, written: int | None = None) -> Usage:
        """OpenAI's convention: ``prompt`` includes the ``cached`` tokens; cache writes (a
        provider's) are reported apart in ``prompt_tokens_details.cache_write_tokens``."""
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=cached, cache_write_tokens=written
            ),
        )


class FunctionCallOut(_Out):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class FunctionDeltaOut(_Out):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDeltaOut(_Out):
    """A streamed tool call: the first delta of a call carries its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDeltaOut

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _no_empty_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Out):
    """Chat logprobs: one entry per generated token."""

    content: list[TokenLogprobOut] | None = None


class ChatChoice(_Out):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids (null when not asked)


def _now() -> int:
    return int(time.time())


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's fields, null unless asked for (its clients read them as attributes)
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None


class ChunkDelta(_Out):
    """A stream delta carries only what changed: absent fields are left out, not null."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(_Out):
    index: int = 0
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Out):
    """Text-completion logprobs (the legacy shape): parallel lists, one entry a token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(_Out):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    # vLLM's fields, null unless asked for (its clients read them as attributes)
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    """A model in OpenAI's shape (vLLM's fields too) and Anthropic's (``type``,
    ``display_name``, ``created_at``): one list serves both APIs' clients."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vcache"
    max_model_len: int | None = None
    root: str | None = None  # the model it serves (a path or hub id), as vLLM reports it
    parent: str | None = None
    type: Literal["model"] = "model"  # Anthropic's

    @computed_field  # type: ignore[prop-decorator]
    @property
    def display_name(self) -> str:
        return self.id

    @computed_field  # type: ignore[prop-decorator]
    @property
    def created_at(self) -> str:
        """``created`` as Anthropic's RFC 3339 time."""
        return datetime.fromtimestamp(self.created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ModelList(_Out):
    """OpenAI's list, with Anthropic's paging fields (every model on one page)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def has_more(self) -> bool:
        return False

    @computed_field  # type: ignore[prop-decorator]
    @property
    def first_id(self) -> str | None:
        return self.data[0].id if self.data else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def last_id(self) -> str | None:
        return self.data[-1].id if self.data else None
