"""Typed OpenAI wire models.

Input models validate (a bad value is a 400 naming the parameter); unknown
input fields are ignored, as most OpenAI-compatible servers do, except the
features this gateway does not implement, which are refused by name.
Output models allow extra fields and are never built as raw dicts.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

# ---------------------------------------------------------------- requests

SEED_MAX = 2**63 - 1  # seeds are 64-bit signed integers, as in OpenAI's API


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string in ``value`` that is not valid Unicode text (a lone
    surrogate such as ``"\\ud800"``, which JSON escapes can carry), or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and lone_surrogate(key) is not None:
            return path or "body"
        sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)
        found = lone_surrogate(item, sub)
        if found is not None:
            return found
    return None


class RequestModel(BaseModel):
    """A request body: every string in it must be valid Unicode (else a 400 naming it)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "the string contains a lone surrogate (it is not valid Unicode text)",
                {"param": found},
            )
        return data


StopText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]  # the upper bound (the vocabulary) is the model's


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


_UNSUPPORTED = ("functions", "function_call", "audio", "modalities")


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """A function tool (OpenAI's shape); hosted providers get their own rendering of it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class SamplingFields(RequestModel):
    """Fields shared by chat and text completions."""

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stop: StopText | list[StopText] | None = None
    seed: Annotated[int, Field(ge=-SEED_MAX - 1, le=SEED_MAX)] | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None

    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise ValueError(f"{info.field_name} is not supported by this gateway")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "text") != "text":
            raise ValueError("only response_format type 'text' is supported")
        return v

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def output_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(
        cls, v: str | list[str] | list[TokenId] | list[list[TokenId]]
    ) -> str | list[str] | list[TokenId] | list[list[TokenId]]:
        if isinstance(v, list) and v and isinstance(v[0], str | list) and len(v) != 1:
            raise ValueError("only one prompt per request is supported")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


# --------------------------------------------------------------- responses


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


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


def _now() -> int:
    return int(time.time())


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(_Out):
    """A stream delta carries only what changed: absent fields are left out, not null."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(_Out):
    index: int = 0
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Out):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vcache"
    max_model_len: int | None = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]
