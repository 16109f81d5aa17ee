"""Typed OpenAI wire models.

Input models validate (a bad value is a 400 naming the parameter); unknown
input fields are ignored, as most OpenAI-compatible servers do, except the
features this gateway does not implement, which are refused by name.
Output models allow extra fields and are never built as raw dicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gateway.core.chat_shaping import ChatShaping
from gateway.core.errors import InvalidRequest
from gateway.core.vllm_params import VllmSampling
from manifest.attachments import Attachment
from manifest.canonical import canonical_json

# ---------------------------------------------------------------- requests

SEED_MAX = 2**63 - 1  # seeds are 64-bit signed integers, as in OpenAI's API
MAX_N = 128  # choices per request, as OpenAI's API
MAX_TOP_LOGPROBS = 20  # chat; text completions allow 5


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


class ImageUrl(BaseModel):
    url: str = Field(min_length=1)  # a data URL, or http(s) from an allowed host
    detail: Literal["auto", "low", "high"] | None = None


class _Attaching(BaseModel):
    """A content part that carries an image or a document: intake
    (gateway/service/attachment_intake.py) decodes or fetches it, checks it and stores
    it, then sets :attr:`attachment` (never read from the wire)."""

    _attachment: Attachment | None = PrivateAttr(default=None)

    @property
    def attachment(self) -> Attachment | None:
        return self._attachment

    def with_attachment(self, attachment: Attachment) -> None:
        self._attachment = attachment


class ImageUrlPart(_Attaching):
    """An image in a chat message (OpenAI's ``image_url`` part); the Messages and
    Responses APIs' images arrive here in this shape too."""

    type: Literal["image_url"]
    image_url: ImageUrl
    # vLLM's extension: the client's identifier of the image, its cache key in place of
    # the bytes' hash (the client asserts that one uuid is one image)
    uuid: str | None = Field(default=None, min_length=1)


class FileData(BaseModel):
    file_data: str | None = None  # a data URL (base64), e.g. a PDF
    filename: str | None = None
    file_id: str | None = None  # refused by name: there is no files API


class FilePart(_Attaching):
    """A document in a chat message (OpenAI's ``file`` part)."""

    type: Literal["file"]
    file: FileData


ContentPart = Annotated[TextPart | ImageUrlPart | FilePart, Field(discriminator="type")]


class FunctionCallIn(BaseModel):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCallIn


def tool_calls_json(calls: list[dict[str, Any]]) -> str:
    """Tool calls (``{id, type, function: {name, arguments}}``) as canonical JSON text."""
    return canonical_json(calls).decode()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # an assistant's thinking blocks as another API sent them (canonical JSON); never
    # read from an OpenAI request
    _thinking: str | None = PrivateAttr(default=None)
    # a system message's tool changes (the Messages API's tool_addition / tool_removal
    # blocks, canonical JSON); never read from an OpenAI request
    _tool_changes: str | None = PrivateAttr(default=None)
    # a message's own output control (the Messages API's per-turn output_config,
    # canonical JSON); never read from an OpenAI request
    _control: str | None = PrivateAttr(default=None)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool's result: which call it answers

    def tool_calls_json(self) -> str | None:
        """The tool calls as canonical JSON (how the session log keeps them)."""
        if not self.tool_calls:
            return None
        return tool_calls_json([c.model_dump() for c in self.tool_calls])

    @property
    def thinking(self) -> str | None:
        return self._thinking

    def with_thinking(self, blocks: list[dict[str, Any]]) -> ChatMessage:
        self._thinking = canonical_json(blocks).decode() if blocks else None
        return self

    @property
    def tool_changes(self) -> str | None:
        return self._tool_changes

    def with_tool_changes(self, blocks: list[dict[str, Any]]) -> ChatMessage:
        self._tool_changes = canonical_json(blocks).decode() if blocks else None
        return self

    @property
    def control(self) -> str | None:
        return self._control

    def with_control(self, control: dict[str, Any] | None) -> ChatMessage:
        self._control = canonical_json(control).decode() if control else None
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far on every chunk


_UNSUPPORTED = ("functions", "function_call", "audio", "modalities")


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """A function tool (OpenAI's shape); hosted providers get their own rendering of it.
    ``defer_loading`` (Anthropic's, set by the Messages API's edge): not offered up front,
    but where a system message adds it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec
    defer_loading: bool | None = None


class NamedFunction(BaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this tool."""

    type: Literal["function"]
    function: NamedFunction


class SamplingFields(RequestModel, VllmSampling):
    """Fields shared by chat and text completions (vLLM's sampling extensions too)."""

    # left out (vLLM allows it): the gateway's local model (GatewayService.named)
    model: Annotated[str, Field(min_length=1)] = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: StopText | list[StopText] | None = None
    seed: Annotated[int, Field(ge=-SEED_MAX - 1, le=SEED_MAX)] | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens
    # token id (as text, as OpenAI's API has it) → bias added to its logit, -100 to 100
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad = [k for k in v or {} if not k.strip().lstrip("-").isdigit() or int(k) < 0]
        if bad:
            names = ", ".join(f"'{k}'" for k in bad)
            are = "is not a token id" if len(bad) == 1 else "are not token ids"
            raise ValueError(f"{names} {are} (logit_bias keys are token ids)")
        return v

    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs, in token order."""
        return tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "value_error",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled",
                {"param": "stream_options"},
            )
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class JsonSchemaSpec(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    """``text``; ``json_object`` (any JSON object); ``json_schema`` (valid against it)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError(
                "value_error",
                "type json_schema needs a json_schema object",
                {"param": "response_format.json_schema"},
            )
        return self


@dataclass(frozen=True)
class Breakpoint:
    """A client's cache breakpoint (Anthropic ``cache_control``): the prompt through
    ``segment`` (``tools``, ``system`` or ``message:i``, i counted after the system
    messages) is to be kept cached for ``ttl_s``."""

    segment: str
    ttl_s: int = 300


@dataclass(frozen=True)
class EdgeHints:
    """What another API's edge (the Messages API, the Responses API) asks of a chat request
    beyond OpenAI's chat fields; never read from the wire."""

    breakpoints: tuple[Breakpoint, ...] = ()
    clamp_output: bool = False  # a max_tokens past the context is cut to fit, not refused
    top_k: int | None = None
    thinking: dict[str, Any] | None = None  # Anthropic's extended thinking, for its targets
    effort: str | None = None  # how hard the model is to think (Responses, Messages effort)
    omitted_tools: tuple[str, ...] = ()  # hosted tools no target here runs, left out
    # Anthropic's context_management as the client sent it: an Anthropic target applies
    # it; elsewhere its clear_thinking edits hold by construction (no target but
    # Anthropic is shown earlier thinking)
    context_management: dict[str, Any] | None = None
    # Anthropic's server-side safeguards (beta dangerous-tool-use-2026-09-03), as sent
    safeguards: list[dict[str, Any]] | None = None

    def anthropic_edits(self) -> list[str]:
        """The context-management edits only Anthropic applies (all but
        ``clear_thinking_*``, which every other target satisfies as it stands)."""
        edits = (self.context_management or {}).get("edits") or []
        kinds = [str(e.get("type", "")) if isinstance(e, dict) else "" for e in edits]
        return [k for k in kinds if not k.startswith("clear_thinking")]

    def refuse_anthropic_only(self, target: str, applies_edits: bool = False) -> None:
        """``target`` (not Anthropic) refuses, by name, what only Anthropic runs: its
        safeguards, and an edit only it applies unless the target ``applies_edits``
        itself (the local model: gateway/service/context_edits.py); an alias moves past
        it."""
        if self.safeguards:
            raise InvalidRequest(
                "safeguards (beta dangerous-tool-use-2026-09-03) are run by Anthropic only, "
                f"not by the target {target}",
                param="safeguards",
                code="unsupported_on_target",
            )
        edits = [] if applies_edits else self.anthropic_edits()
        if edits:
            raise InvalidRequest(
                f"context_management edit '{edits[0]}' is applied by Anthropic only, not by "
                f"the target {target}",
                param="context_management.edits",
                code="unsupported_on_target",
            )


class ChatCompletionRequest(SamplingFields, ChatShaping):
    _hints: EdgeHints = PrivateAttr(default_factory=EdgeHints)

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None

    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's stable session identity: the session, where no header names one
    session_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")] | None = None
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

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError(
                "value_error",
                "top_logprobs needs logprobs: true",
                {"param": "top_logprobs"},
            )
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice in (None, "none"):  # "none" needs no tools; every other choice does
            return self
        names = {t.function.name for t in self.tools or []}
        if not names:
            raise PydanticCustomError(
                "value_error", "tool_choice needs tools", {"param": "tool_choice"}
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError(
                "value_error",
                "tool_choice names '{name}', which is not among the tools",
                {"param": "tool_choice", "name": choice.function.name},
            )
        return self

    @model_validator(mode="after")
    def _continue_an_assistant_message(self) -> ChatCompletionRequest:
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise PydanticCustomError(
                "value_error",
                "continue_final_message needs add_generation_prompt: false (vLLM's rule: "
                "the answer either starts a new message or continues the last)",
                {"param": "continue_final_message"},
            )
        if self.messages[-1].role != "assistant":
            raise PydanticCustomError(
                "value_error",
                "continue_final_message needs the last message to be the assistant's",
                {"param": "continue_final_message"},
            )
        return self

    def template(self) -> dict[str, Any]:
        """The prompt shaping this request asks for, where it is not the default (what the
        session log keeps to render it again)."""
        out = self.shaping()
        if self.truncate_prompt_tokens is not None:  # resolved against the context later
            out["truncate_prompt_tokens"] = self.truncate_prompt_tokens
            if self.truncation_side is not None:
                out["truncation_side"] = self.truncation_side
        return out

    @property
    def hints(self) -> EdgeHints:
        return self._hints

    def with_hints(self, hints: EdgeHints) -> ChatCompletionRequest:
        """A copy of this request (shallow: the messages are shared, never changed) with
        ``hints``; this one is left as it was."""
        copy = self.model_copy()
        copy._hints = hints  # the copy is new: no one else holds it yet
        return copy

    def attachment_parts(self) -> Iterator[tuple[str, ImageUrlPart | FilePart]]:
        """Each image and document part of the messages, in order, with its name in the
        request (``messages[2].content[1]``)."""
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for j, p in enumerate(m.content):
                    if not isinstance(p, TextPart):
                        yield f"messages[{i}].content[{j}]", p

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token the client wants (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def structured(self) -> ResponseFormat | None:
        f = self.response_format
        return None if f is None or f.type == "text" else f

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def echoed(self) -> str:
        """What an answer repeats first (vLLM's ``echo``): the last message's text where
        it is the assistant's (the one being continued)."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        return last.text()

    def output_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )
