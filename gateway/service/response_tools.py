"""The Responses API's tools as the model sees them, and its calls mapped back.

Every target the gateway serves through the chat path takes function tools,
so a Responses request's tools are rendered into them once, by one rule the
session log keeps (the rendered tools are the header's):

- a ``function`` tool is itself;
- a ``custom`` (freeform) tool is a function of one string argument,
  ``input``; a grammar it declares is written into its description (the
  local tool parser carries JSON, so the grammar guides the model but is not
  enforced); the model's call comes back as a ``custom_tool_call`` item whose
  ``input`` is that string;
- a ``namespace`` tool contributes the tools it holds, each named
  ``<namespace>__<name>`` (the ``mcp__server__tool`` convention the agents use
  themselves), its description opening with the namespace's; the call comes
  back with its own ``name`` and its ``namespace``;
- a hosted tool (``web_search``, ``file_search``, ``code_interpreter``,
  ``image_generation``, ``mcp``, ``computer_use``...) runs at OpenAI only: no
  target here can run it, so it is left out of what the model sees, the
  header snapshot records it as left out and the response names it
  (``x-vcache-tools-omitted``); a ``tool_choice`` that requires one is a 400
  naming it.

``reasoning`` items sent back are dropped before rendering (the local model's
earlier thinking is not part of its prompt, as OpenAI's reasoning models drop
it between user turns), so the prompt of each turn extends the last byte for
byte whatever reasoning the client keeps.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.core.errors import InvalidRequest
from gateway.core.responses_wire import (
    CustomTool,
    FunctionChoice,
    FunctionTool,
    HostedTool,
    NamespaceTool,
    ResponsesRequest,
)
from gateway.core.schemas import FunctionSpec, ToolSpec

OMITTED_HEADER = "x-vcache-tools-omitted"
NAMESPACE_SEPARATOR = "__"

Kind = Literal["function", "custom"]


@dataclass(frozen=True)
class Origin:
    """What a function the model sees stands for: a tool of the request's, of a
    namespace or not, function or custom."""

    name: str
    kind: Kind = "function"
    namespace: str | None = None


@dataclass(frozen=True)
class ResponseTools:
    """The request's tools in chat's terms, the hosted tools left out, and how a call
    of each chat function maps back to the request's tools."""

    chat: tuple[ToolSpec, ...] = ()
    omitted: tuple[str, ...] = ()
    origins: Mapping[str, Origin] = field(default_factory=dict)

    def origin(self, chat_name: str) -> Origin:
        """The tool a call of ``chat_name`` stands for (a name the model made up: a
        function of that name)."""
        return self.origins.get(chat_name) or Origin(chat_name)


def chat_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


CUSTOM_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "the tool's input, as text"}},
    "required": ["input"],
}


def _description(tool: FunctionTool | CustomTool, namespace: NamespaceTool | None) -> str | None:
    parts = []
    if namespace is not None and namespace.description:
        parts.append(f"[{namespace.name}] {namespace.description}")
    if tool.description:
        parts.append(tool.description)
    if isinstance(tool, CustomTool) and tool.format is not None and tool.format.definition:
        syntax = tool.format.syntax or "lark"
        parts.append(f"The input must match this {syntax} grammar:\n{tool.format.definition}")
    return "\n\n".join(parts) or None


def _spec(tool: FunctionTool | CustomTool, namespace: NamespaceTool | None) -> ToolSpec:
    # namespaced names may pass chat's 64 characters: built as validated by the request
    params = tool.parameters if isinstance(tool, FunctionTool) else CUSTOM_PARAMETERS
    strict = tool.strict if isinstance(tool, FunctionTool) else None
    fn = FunctionSpec.model_construct(
        name=chat_name(tool.name, namespace.name if namespace else None),
        description=_description(tool, namespace),
        parameters=params,
        strict=strict,
    )
    return ToolSpec.model_construct(type="function", function=fn)


def response_tools(tools: Sequence[Any] | None) -> ResponseTools:
    """The request's tools rendered for the chat path (see the module's rules)."""
    chat: list[ToolSpec] = []
    omitted: list[str] = []
    origins: dict[str, Origin] = {}

    def add(tool: FunctionTool | CustomTool, ns: NamespaceTool | None) -> None:
        spec = _spec(tool, ns)
        name = spec.function.name
        if name in origins:
            raise InvalidRequest(
                f"tools: two tools are named '{name}'", param="tools", code="invalid_value"
            )
        kind: Kind = "custom" if isinstance(tool, CustomTool) else "function"
        origins[name] = Origin(tool.name, kind, ns.name if ns else None)
        chat.append(spec)

    for tool in tools or ():
        if isinstance(tool, NamespaceTool):
            for inner in tool.tools:
                add(inner, tool)
        elif isinstance(tool, FunctionTool | CustomTool):
            add(tool, None)
        elif isinstance(tool, HostedTool) and tool.type not in omitted:
            omitted.append(tool.type)
    return ResponseTools(tuple(chat), tuple(omitted), origins)


def chat_tool_choice(req: ResponsesRequest, tools: ResponseTools) -> Any:
    """``tool_choice`` in chat's terms; one that needs a tool the model cannot see (a
    hosted tool left out, a tool not given) is a 400 naming it."""
    choice = req.tool_choice
    if choice is None or choice == "none":
        return choice
    if isinstance(choice, str):
        if choice == "auto" and not tools.chat:
            return None  # nothing to call: the model answers (Codex's compaction turn)
        if not tools.chat:
            left = f" (left out: {', '.join(tools.omitted)})" if tools.omitted else ""
            raise InvalidRequest(
                f"tool_choice '{choice}' needs a tool the model can call{left}",
                param="tool_choice",
                code="unsupported_on_target",
            )
        return choice
    if isinstance(choice, FunctionChoice):
        name = chat_name(choice.name, choice.namespace)
        found = tools.origins.get(name)
        if found is None or found.kind != choice.type:
            raise InvalidRequest(
                f"tool_choice names the {choice.type} tool '{choice.name}', which is not "
                "among the tools",
                param="tool_choice.name",
                code="invalid_value",
            )
        return {"type": "function", "function": {"name": name}}
    if choice.type == "allowed_tools":  # what is left: a HostedChoice
        raise InvalidRequest(
            "tool_choice of type 'allowed_tools' is not supported by this gateway",
            param="tool_choice.type",
            code="unsupported_value",
        )
    raise InvalidRequest(
        f"tool_choice requires the hosted tool '{choice.type}', which runs at OpenAI only: "
        "no target of this gateway can run it",
        param="tool_choice.type",
        code="unsupported_on_target",
    )


def custom_arguments(text: str) -> str:
    """A custom tool's input as the arguments of the function that stands for it."""
    return json.dumps({"input": text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The input of a custom tool call from the arguments the model wrote (text that is
    not the one-argument object is the input itself)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments
