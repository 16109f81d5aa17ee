"""Typed wire models of Anthropic's Messages API (``POST /v1/messages``).

Input models validate as Anthropic does and refuse fields it does not
document (a 400 naming the field: a client that sends them expects
something this gateway would otherwise silently not do).  Output models
allow extra fields and are never built as raw dicts.  Images (``image``:
base64 or URL sources) and documents (``document``: a base64 PDF or a text
source) are read, in a turn and in a ``tool_result``; what this gateway cannot
serve (``search_result`` and ``container_upload`` blocks, Files API ``file``
sources, a URL or ``content`` document source, citations) is refused by name
when the request is mapped (:mod:`gateway.service.messages_api`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gateway.core.schemas import RequestModel

# ---------------------------------------------------------------- requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    """A cache breakpoint: the prefix through this block is cached for ``ttl``."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    def ttl_s(self) -> int:
        return 3600 if self.ttl == "1h" else 300


class Citation(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Citation] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolReferenceBlock(_Strict):
    """A tool a tool search found (in a ``tool_result``): a deferred tool the model may
    call from here on."""

    type: Literal["tool_reference"]
    tool_name: str = Field(min_length=1)
    cache_control: CacheControl | None = None


class Base64Source(_Strict):
    """An image's or a PDF's bytes, in base64."""

    type: Literal["base64"]
    media_type: Literal["image/png", "image/jpeg", "image/gif", "image/webp", "application/pdf"]
    data: str = Field(min_length=1)


class UrlSource(_Strict):
    """An image (or a PDF) at a URL: fetched by the gateway from allowed hosts only."""

    type: Literal["url"]
    url: str = Field(min_length=1)


class TextSource(_Strict):
    """A plain-text document."""

    type: Literal["text"]
    media_type: Literal["text/plain"]
    data: str


class OtherSource(BaseModel):
    """A source this gateway cannot read (a Files API ``file_id``, a ``content``
    document): refused by name when the request is mapped."""

    model_config = ConfigDict(extra="allow")
    type: Literal["file", "content"]


class ImageBlock(_Strict):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource | OtherSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None


class CitationsConfig(_Strict):
    enabled: bool | None = None


class DocumentBlock(_Strict):
    type: Literal["document"]
    source: Annotated[
        Base64Source | UrlSource | TextSource | OtherSource, Field(discriminator="type")
    ]
    title: str | None = None
    context: str | None = None
    citations: CitationsConfig | None = None
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: (
        str
        | list[
            Annotated[
                TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock,
                Field(discriminator="type"),
            ]
        ]
        | None
    ) = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    def references(self) -> list[dict[str, Any]]:
        """The tools it found, as written."""
        if not isinstance(self.content, list):
            return []
        return [
            b.model_dump(exclude_none=True, exclude={"cache_control"})
            for b in self.content
            if isinstance(b, ToolReferenceBlock)
        ]


class ThinkingBlock(_Strict):
    """A thinking block of an earlier assistant turn, sent back with its signature."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControl | None = None


class ToolRef(BaseModel):
    """What a tool change names: a tool of ``tools`` (``tool_reference``), an MCP tool or
    toolset, or a tool given inline (``tool_definition``, beta ``inline-tools-2026-09-15``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal[
        "tool_reference", "mcp_tool_reference", "mcp_toolset_reference", "tool_definition"
    ]
    name: str | None = None
    server_name: str | None = None
    definition: dict[str, Any] | None = None


class ToolAdditionBlock(_Strict):
    """A system message's ``tool_addition``: the tool is offered from here on (beta
    ``mid-conversation-tool-changes-2026-07-01``)."""

    type: Literal["tool_addition"]
    tool: ToolRef
    cache_control: CacheControl | None = None


class ToolRemovalBlock(_Strict):
    """A system message's ``tool_removal``: the tool is no longer offered from here on."""

    type: Literal["tool_removal"]
    tool: ToolRef
    cache_control: CacheControl | None = None


UNSUPPORTED_CONTENT = ("search_result", "container_upload")


class UnsupportedBlock(BaseModel):
    """Content this gateway does not read: refused by name when the request is mapped."""

    model_config = ConfigDict(extra="allow")
    type: Literal["search_result", "container_upload"]


ContentBlock = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ToolAdditionBlock
    | ToolRemovalBlock
    | UnsupportedBlock,
    Field(discriminator="type"),
]


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class MessageParam(_Strict):
    """A turn; ``system`` is a mid-conversation system message (text and tool changes),
    placed as Anthropic's rules allow (see :meth:`MessagesRequest._placed`)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]
    cache_control: CacheControl | None = None  # a system message's, as on the system field
    # per-turn control (beta per-turn-control-2026-07-01): the effort from here on
    output_config: OutputConfig | None = None

    def blocks(self) -> list[Any]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class ToolParam(_Strict):
    """A client tool.  Server tools (web search, code execution) run at Anthropic only."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None  # offered only where a system message adds it
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise PydanticCustomError(
                "value_error", "tool_choice.name is required when type is 'tool'", {}
            )
        return self


Display = Literal["summarized", "omitted", "updates"]  # how the thinking is shown


class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1024)]
    display: Display | None = None


class ThinkingOther(_Strict):
    type: Literal["disabled", "adaptive"]
    display: Display | None = None


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=512)


class MessagesRequest(RequestModel):
    """``POST /v1/messages``: what Anthropic's API documents, nothing else."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)]
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    metadata: Metadata | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Annotated[ThinkingEnabled | ThinkingOther, Field(discriminator="type")] | None = None
    context_management: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    output_config: OutputConfig | None = None
    container: str | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    cache_control: CacheControl | None = None  # automatic caching: a mark on the last block
    inference_geo: str | None = None  # where Anthropic runs it: nothing to do here
    speed: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Anthropic's server-side classifiers (beta dangerous-tool-use-2026-09-03): Anthropic
    # targets only
    safeguards: list[dict[str, Any]] | None = None

    @field_validator("container", "mcp_servers")
    @classmethod
    def _server_side_only(cls, v: Any) -> Any:
        if v:
            raise ValueError("runs on Anthropic's servers only; this gateway does not provide it")
        return v

    @model_validator(mode="after")
    def _placed(self) -> MessagesRequest:
        """Anthropic's placement rules for system messages: never first; right after a
        user turn; last, or followed by an assistant turn (so never two in a row); text
        and tool changes only, and tool changes nowhere else."""
        msgs = self.messages
        names = {t.name for t in self.tools or []}
        for i, m in enumerate(msgs):
            where = f"messages.{i}"
            kinds = [b.type for b in m.content] if isinstance(m.content, list) else ["text"]
            if m.role != "system":
                if "tool_addition" in kinds or "tool_removal" in kinds:
                    raise _error(f"{where}: tool changes belong in a system message", where)
                if m.cache_control is not None:
                    raise _error(f"{where}.cache_control: put it on a content block", where)
                continue
            if i == 0:
                raise _error(
                    f"{where}: a system message cannot be the first message; use the "
                    "top-level system field",
                    where,
                )
            if msgs[i - 1].role != "user":
                raise _error(f"{where}: a system message must follow a user message", where)
            if i + 1 < len(msgs) and msgs[i + 1].role != "assistant":
                raise _error(
                    f"{where}: a system message must be the last message or be followed by "
                    "an assistant message",
                    where,
                )
            for j, b in enumerate(m.content if isinstance(m.content, list) else []):
                if b.type not in ("text", "tool_addition", "tool_removal"):
                    raise _error(
                        f"{where}.content.{j}: a system message takes text and tool changes, "
                        f"not '{b.type}' blocks",
                        f"{where}.content.{j}.type",
                    )
                if isinstance(b, ToolAdditionBlock | ToolRemovalBlock):
                    ref = b.tool
                    if ref.type == "tool_reference" and ref.name not in names:
                        raise _error(
                            f"{where}.content.{j}.tool.name: '{ref.name}' is not among the tools",
                            f"{where}.content.{j}.tool.name",
                        )
                    if ref.type == "tool_definition" and not (ref.definition or {}).get("name"):
                        raise _error(
                            f"{where}.content.{j}.tool.definition: a tool definition needs a name",
                            f"{where}.content.{j}.tool.definition",
                        )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> MessagesRequest:
        t = self.thinking
        if isinstance(t, ThinkingEnabled) and t.budget_tokens >= self.max_tokens:
            raise PydanticCustomError(
                "value_error",
                "thinking.budget_tokens must be less than max_tokens",
                {"param": "thinking.budget_tokens"},
            )
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            names = {tool.name for tool in self.tools or []}
            if choice.name not in names:
                raise PydanticCustomError(
                    "value_error",
                    "tool_choice names '{name}', which is not among the tools",
                    {"param": "tool_choice.name", "name": choice.name},
                )
        return self

    def system_blocks(self) -> list[TextBlock]:
        if self.system is None:
            return []
        if isinstance(self.system, str):
            return [TextBlock(type="text", text=self.system)] if self.system else []
        return list(self.system)


def _error(message: str, param: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", message, {"param": param})


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: Annotated[int, Field(ge=1)] = 1 << 30


# ---------------------------------------------------------------- answers


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class MessageUsage(_Out):
    """Anthropic's terms: ``input_tokens`` excludes what was read from or written to
    the cache; the three together are the prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = 0
    cache_read_input_tokens: int | None = 0
    service_tier: str | None = "standard"


class TextOut(_Out):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(_Out):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(_Out):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class RedactedThinkingOut(_Out):
    type: Literal["redacted_thinking"] = "redacted_thinking"
    data: str


Block = TextOut | ToolUseOut | ThinkingOut | RedactedThinkingOut


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]


class Message(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Block]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(_Out):
    input_tokens: int


# ---------------------------------------------------------------- stream events


class MessageStart(_Out):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStart(_Out):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: Block


class TextDelta(_Out):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(_Out):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(_Out):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(_Out):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class ContentBlockDelta(_Out):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class ContentBlockStop(_Out):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(_Out):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDelta(_Out):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: MessageUsage  # cumulative totals: they overwrite message_start's


class MessageStop(_Out):
    type: Literal["message_stop"] = "message_stop"


class Ping(_Out):
    type: Literal["ping"] = "ping"


class ErrorDetail(_Out):
    type: str
    message: str


class ErrorEvent(_Out):
    """An error body, and the ``error`` event of a stream that fails after it began."""

    type: Literal["error"] = "error"
    error: ErrorDetail
    request_id: str | None = None


StreamEvent = (
    MessageStart
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
    | Ping
    | ErrorEvent
)
