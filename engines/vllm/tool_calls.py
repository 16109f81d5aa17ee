"""vLLM's tool-call parsers over a finished answer's text (the local model's ``auto``
tool choice): which tools the model called, and the text before the calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engines.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class ParsedCalls:
    content: str | None  # the text before the calls (None: none)
    calls: tuple[tuple[str, str], ...]  # (function name, arguments as JSON text)


def known_parser(name: str) -> bool:
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    return name in ToolParserManager.tool_parsers or name in ToolParserManager.lazy_parsers


class ToolCallParser:
    """One of vLLM's registered parsers (``hermes``, ``llama3_json``, ``mistral`` ...),
    chosen to match the model's chat template."""

    def __init__(self, name: str, tokenizer: ChatTokenizer) -> None:
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

        self.name = name
        self._parser = ToolParserManager.get_tool_parser(name)(tokenizer.hf)
        # where a call starts, for parsers that mark it (text before it can stream)
        self.start_marker: str | None = getattr(self._parser, "tool_call_start_token", None)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedCalls:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest.model_validate(
            {"model": "local", "messages": [{"role": "user", "content": ""}], "tools": tools}
        )
        found = self._parser.extract_tool_calls(text, request)
        if not found.tools_called:
            return ParsedCalls(text, ())
        calls = tuple((c.function.name, c.function.arguments) for c in found.tool_calls)
        return ParsedCalls(found.content or None, calls)
