"""The Responses API's wire types, as OpenAI documents them for agents (OpenAPI 2.3).

Input is a string or a list of items: messages, an assistant's
``function_call`` / ``custom_tool_call`` items and the client's
``*_output`` items (the tool round trip an agent sends back on its next
turn), and ``reasoning`` items from earlier answers (accepted and not shown
to the model: see :mod:`gateway.service.response_tools`).  Tools are
``function`` tools, ``custom`` (freeform) tools, ``namespace`` tools that
group them, and hosted tools (``web_search``, ``file_search``...), which are
kept as sent: a target that cannot run them leaves them out.  Images
(``input_image``: a data URL or an http(s) URL, with ``detail``) and files
(``input_file``: a data URL with its ``filename``) are read in messages and in
a call's output.  What OpenAI defines and this gateway cannot do (``file_id``
and ``file_url`` files: there is no files API; audio, prompt templates,
background runs, stored conversations) is a 400 naming it, never ignored.
The answer is a :class:`ResponseObject` whose ``output`` holds a message item
and one call item per tool call; a stream is the typed events below, each
with its ``sequence_number``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from gateway.core.schemas import RequestModel


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: str


def _no_file_id(v: str | None) -> str | None:
    if v is not None:
        raise ValueError("file_id is not supported: there is no files API; send the data itself")
    return v


class InputImage(BaseModel):
    """An image: a data URL (base64) or an http(s) URL the gateway may fetch."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_image"]
    image_url: str | None = None
    detail: Literal["low", "high", "auto"] | None = None
    uuid: str | None = Field(default=None, min_length=1)  # vLLM's: the image's cache identity
    file_id: str | None = None

    _file_id = field_validator("file_id")(_no_file_id)

    @field_validator("image_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("data:", "http://", "https://")):
            raise ValueError("input_image.image_url: a data URL or an http(s) URL")
        return v

    @model_validator(mode="after")
    def _given(self) -> InputImage:
        if self.image_url is None:
            raise ValueError("input_image needs an image_url")
        return self


class InputFile(BaseModel):
    """A file (a PDF) as a data URL, with its name."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_file"]
    file_data: str | None = None
    filename: str | None = None
    file_id: str | None = None
    file_url: str | None = None

    _file_id = field_validator("file_id")(_no_file_id)

    @field_validator("file_url")
    @classmethod
    def _no_file_url(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("input_file.file_url is not supported; send file_data")
        return v

    @field_validator("file_data")
    @classmethod
    def _data_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("data:"):
            raise ValueError("input_file.file_data: a data URL (data:<type>;base64,...)")
        return v

    @model_validator(mode="after")
    def _given(self) -> InputFile:
        if self.file_data is None:
            raise ValueError("input_file needs file_data")
        return self


Part = Annotated[ContentPart | InputImage | InputFile, Field(discriminator="type")]
_PART_TYPES = ("input_text", "output_text", "text", "input_image", "input_file")


def _refuse_parts(v: Any) -> Any:
    """A part that is none of text, an image or a file (audio...) is refused by name."""
    if isinstance(v, list):
        for p in v:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind not in (None, *_PART_TYPES):
                raise ValueError(f"content parts of type '{kind}' are not supported")
    return v


def _text(parts: str | list[Any]) -> str:
    if isinstance(parts, str):
        return parts
    return "".join(p.text for p in parts if isinstance(p, ContentPart))


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]

    _parts = field_validator("content", mode="before")(_refuse_parts)

    def text(self) -> str:
        return _text(self.content)


class _Call(BaseModel):
    """What an assistant's call item carries, whatever the tool."""

    model_config = ConfigDict(extra="ignore")

    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: str | None = None  # the namespace tool the called tool belongs to
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Call):
    """An assistant's call of a function tool (from an earlier response's output)."""

    type: Literal["function_call"]
    arguments: str


class CustomToolCallItem(_Call):
    """An assistant's call of a custom (freeform) tool: its ``input`` is free text."""

    type: Literal["custom_tool_call"]
    input: str


class _Output(BaseModel):
    """What the client's result of a call carries, whatever the tool."""

    model_config = ConfigDict(extra="ignore")

    call_id: str = Field(min_length=1)
    output: str | list[Part]
    id: str | None = None
    status: str | None = None

    _parts = field_validator("output", mode="before")(_refuse_parts)

    def text(self) -> str:
        return _text(self.output)


class FunctionCallOutputItem(_Output):
    """The client's result of a function call."""

    type: Literal["function_call_output"]


class CustomToolCallOutputItem(_Output):
    """The client's result of a custom tool call."""

    type: Literal["custom_tool_call_output"]


class ReasoningItem(BaseModel):
    """A reasoning item of an earlier answer (vcache's or OpenAI's), sent back as the
    client received it (``encrypted_content`` when it asked for it)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


# a tool's name, as OpenAI allows it
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
# a hosted tool's type, e.g. web_search_preview_2025_03_11 (it is named in a header)
ToolType = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class CustomFormat(BaseModel):
    """A custom tool's input format: free text, or text a grammar (Lark or a regex)
    accepts."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(BaseModel):
    """A freeform tool: the model's call carries text, not JSON arguments."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["custom"]
    name: ToolName
    description: str | None = None
    format: CustomFormat | None = None
    defer_loading: bool | None = None


class NamespaceTool(BaseModel):
    """Function and custom tools grouped under a name (an MCP server's, a sub-agent
    kit's); the calls of its tools name the namespace."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["namespace"]
    name: ToolName
    description: str = ""
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]] = Field(
        min_length=1
    )


class HostedTool(BaseModel):
    """A tool OpenAI runs itself (``web_search``, ``file_search``, ``code_interpreter``,
    ``image_generation``, ``mcp``, ``computer_use``...): kept as sent."""

    model_config = ConfigDict(extra="allow")

    type: ToolType


def _tool_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in ("function", "custom", "namespace") else "hosted"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_kind),
]


class FunctionChoice(BaseModel):
    """Call this tool: a function tool (of a namespace, when it names one) or a custom
    tool."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function", "custom"]
    name: str = Field(min_length=1)
    namespace: str | None = None


class HostedChoice(BaseModel):
    """A ``tool_choice`` that names a hosted tool (``{"type": "web_search"}``), or an
    ``allowed_tools`` / ``mcp`` choice: kept as sent, judged against the target."""

    model_config = ConfigDict(extra="allow")

    type: ToolType


def _choice_kind(v: Any) -> str:
    if isinstance(v, str):
        return "mode"
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "named" if kind in ("function", "custom") else "hosted"


ToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("mode")]
    | Annotated[FunctionChoice, Tag("named")]
    | Annotated[HostedChoice, Tag("hosted")],
    Discriminator(_choice_kind),
]


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON valid against ``schema``."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("text.format json_schema needs a name and a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(BaseModel):
    """``reasoning``: how hard the model thinks (``effort``, the chat template's
    ``reasoning_effort`` on the local model) and the summary asked of its thinking."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    # which turns' reasoning the model keeps (Codex sends "all_turns"); no target here is
    # shown earlier reasoning (see gateway/service/response_tools.py), so it changes nothing
    context: Literal["all_turns", "current_turn", "last_turn"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class AdditionalToolsItem(BaseModel):
    """Tools given in the input rather than in ``tools`` (Codex's "responses-lite" models
    send their namespace tools so, as the first item): offered with ``tools``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["additional_tools"]
    id: str | None = None
    role: Literal["developer", "system"] | None = None
    tools: list[Tool]


InputItem = Annotated[
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | CustomToolCallItem
    | CustomToolCallOutputItem
    | ReasoningItem
    | AdditionalToolsItem,
    Field(discriminator="type"),
]
Item = (
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | CustomToolCallItem
    | CustomToolCallOutputItem
    | ReasoningItem
    | AdditionalToolsItem
)
_ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "additional_tools",
)


INCLUDABLE = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
    }
)


class ResponsesRequest(RequestModel):
    model: str = Field(min_length=1)
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    metadata: dict[str, str] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # the session's name and the routing affinity where no header names one
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    prompt_cache_retention: Literal["in-memory", "24h", "in_memory"] | None = None
    client_metadata: dict[str, Any] | None = None  # the client's own: echoed, never read
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension, as on chat completions
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, v: Any) -> Any:
        """An item without a type is a message (OpenAI's easy input); an item of a type
        this gateway does not serve is refused by name."""
        if not isinstance(v, list):
            return v
        out = []
        for item in v:
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}
            kind = item.get("type") if isinstance(item, dict) else None
            if kind not in _ITEM_TYPES:
                raise ValueError(f"input items of type '{kind}' are not supported")
            out.append(item)
        return out

    @field_validator("include")
    @classmethod
    def _includable(cls, v: list[str] | None) -> list[str] | None:
        unknown = sorted(set(v or ()) - INCLUDABLE)
        if unknown:
            raise ValueError(f"include: '{unknown[0]}' is not a value this API defines")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("background responses are not supported")
        return v

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("conversation is not supported; use previous_response_id")
        return v

    @field_validator("prompt")
    @classmethod
    def _no_prompt_templates(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError(
                "prompt templates (prompt.id) are not supported by this gateway: send the "
                "instructions and input themselves"
            )
        return v

    def items(self) -> list[Item]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None else TextFormat()

    def all_tools(self) -> list[Any]:
        """``tools``, then those of every ``additional_tools`` item, in order."""
        extra = [t for i in self.items() if isinstance(i, AdditionalToolsItem) for t in i.tools]
        return [*(self.tools or []), *extra]


# ------------------------------------------------------------------ the answer


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = None  # the namespace tool the function belongs to


class OutputCustomToolCall(BaseModel):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str
    call_id: str
    name: str
    input: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = None


OutputItem = OutputMessage | OutputFunctionCall | OutputCustomToolCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    # tokens written to the provider's cache (the openai SDK's ResponseUsage requires
    # the field: 0 where nothing was billed as a write, the local replicas' included)
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class Incomplete(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: Incomplete | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: TextConfig
    tool_choice: ToolChoice
    tools: list[Tool]
    truncation: Literal["disabled", "auto"]
    metadata: dict[str, str]
    usage: ResponseUsage | None
    reasoning: Reasoning = Field(default_factory=Reasoning)
    max_tool_calls: int | None = None
    service_tier: str = "default"  # what served it: the gateway has one tier
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# ------------------------------------------------------------------ stream events


class StreamEvent(BaseModel):
    type: str
    sequence_number: int


class ResponseState(StreamEvent):
    """``response.created`` / ``in_progress`` / ``completed`` / ``incomplete``."""

    response: ResponseObject


class ItemEvent(StreamEvent):
    """``response.output_item.added`` / ``done``."""

    output_index: int
    item: OutputItem


class PartEvent(StreamEvent):
    """``response.content_part.added`` / ``done``."""

    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText


class TextDelta(StreamEvent):
    type: str = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDone(StreamEvent):
    type: str = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDelta(StreamEvent):
    type: str = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(StreamEvent):
    type: str = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class CustomInputDelta(StreamEvent):
    type: str = "response.custom_tool_call_input.delta"
    item_id: str
    output_index: int
    delta: str


class CustomInputDone(StreamEvent):
    type: str = "response.custom_tool_call_input.done"
    item_id: str
    output_index: int
    input: str


class ErrorEvent(StreamEvent):
    """A stream that fails after it started ends with this event."""

    type: str = "error"
    code: str | None
    message: str
    param: str | None
