"""The Responses API's wire types, as OpenAI defines them for agents.

Input is a string or a list of items: messages, an assistant's
``function_call`` items and the client's ``function_call_output`` items (the
tool round trip an agent SDK sends back on its next turn).  Tools are
function tools; ``text.format`` asks for JSON (an object, or one valid
against a schema).  What OpenAI defines and this gateway cannot do (hosted
tools, images, files, background runs) is a 400 naming it, never ignored.
The answer is a :class:`ResponseObject` whose ``output`` holds a message item
and one ``function_call`` item per call; a stream is the typed events below,
each with its ``sequence_number``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.core.schemas import RequestModel


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: str


def _refuse_parts(v: Any) -> Any:
    """A message part that is not text (an image, a file, audio) is refused by name."""
    if isinstance(v, list):
        for p in v:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind not in (None, "input_text", "output_text", "text"):
                raise ValueError(f"content parts of type '{kind}' are not supported")
    return v


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    _parts = field_validator("content", mode="before")(_refuse_parts)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """An assistant's call of a function tool (from an earlier response's output)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """The client's result of a function call."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")
]
_ITEM_TYPES = ("message", "function_call", "function_call_output")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON valid against ``schema``."""

    model_config = ConfigDict(populate_by_name=True)

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
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    ignore_eos: bool = False  # vLLM extension, as on chat completions
    background: bool | None = None
    conversation: Any = None

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

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v  # not a list: the type check names it
        for t in v:
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise ValueError(f"tools of type '{kind}' are not supported (function tools are)")
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

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None else TextFormat()


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


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


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
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice
    tools: list[FunctionTool]
    truncation: Literal["disabled", "auto"]
    metadata: dict[str, str]
    usage: ResponseUsage | None


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


class ErrorEvent(StreamEvent):
    """A stream that fails after it started ends with this event."""

    type: str = "error"
    code: str | None
    message: str
    param: str | None
