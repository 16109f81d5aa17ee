"""The local model's prompts, rendered on the render thread (a short one on the loop).

A chat renders through the model's template from the parts the session log
keeps (system prompts, turns, tools in canonical JSON), so a rebuilt request
renders the same (a vision model's image tokens then expanded here too,
:meth:`Prompts.expanded`).  One job per request gives the prompt's ids and where the
governor's anchor (the system prompts and tools) and each client breakpoint
end in them (:class:`~gateway.service.breakpoints.PrefixLengths`, whose
memory only the job running touches).  Each job says how many characters it
may tokenize afresh, counted before it renders: the request's text (its
system prompts, turns and tools' JSON) once for each render its memories do
not answer, none for a template of the request's own (not bounded: always
the thread) or an image's expansion; the render thread runs a job under
its bound on the loop (:mod:`gateway.service.render_thread`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.tokenizer import ChatTokenizer
from gateway.core.schemas import Breakpoint
from gateway.local.vision_prompt import PromptImage, VisionPrompt, VisionRenderer
from gateway.service.breakpoints import Ends, PrefixLengths, SystemPrompts, Turns
from gateway.service.render_thread import RenderThread
from gateway.sessions.render import chat_prompt, local_messages, text_prompt
from manifest.canonical import canonical_json
from manifest.sessionlog import MessageEvent

Tools = list[dict[str, Any]] | None
Template = Mapping[str, Any] | None


@dataclass(frozen=True)
class PromptIds:
    """A chat prompt's token ids, with where its parts end: the system prompts and tools
    (the governor's anchor, when asked and there are system prompts) and each client
    breakpoint."""

    ids: list[int]
    anchor: int = 0
    ends: Ends = field(default_factory=list)


class Prompts:
    """Renders and tokenizes with a copy of the model's tokenizer, off the event loop."""

    def __init__(self, inline_chars: int = 0) -> None:
        """``inline_chars``: the most characters a render on the loop may tokenize afresh
        (0: every render on the thread)."""
        self._thread = RenderThread(inline_chars)
        self._prefix = PrefixLengths()  # prefix token lengths, remembered

    async def chat(
        self,
        tok: ChatTokenizer,
        system: SystemPrompts,
        turns: Turns,
        tools: Tools,
        template: Template = None,
    ) -> list[int]:
        """The prompt's token ids through the chat template."""

        def fresh() -> int | None:
            return None if _own_template(template) else chars(system, turns, tools)

        return await self._thread.run(
            tok, lambda t: render(t, system, turns, tools, template), fresh
        )

    async def rendered(
        self,
        tok: ChatTokenizer,
        system: SystemPrompts,
        turns: Turns,
        tools: list[dict[str, Any]],
        template: Mapping[str, Any],
        anchor: bool = False,
        marks: Sequence[Breakpoint] = (),
        memo: list[int] | None = None,
    ) -> PromptIds:
        """The prompt (``memo``: rendered already, to quote), and where the anchor (if
        ``anchor`` and there are system prompts) and the breakpoints ``marks`` end in it."""
        anchor = anchor and bool(system)
        prefix = self._prefix

        def job(t: ChatTokenizer) -> PromptIds:
            r = functools.partial(render, t)
            ids = memo if memo is not None else r(system, turns, tools, template)
            n = prefix(r, system, (), tools, ids) if anchor else 0
            ends = prefix.ends(r, marks, system, turns, tools, ids) if marks else []
            return PromptIds(ids, n, ends)

        def fresh() -> int | None:  # each render the memories do not answer: all of it
            if _own_template(template):
                return None
            renders = (memo is None) + prefix.renders(anchor, marks, system, turns, tools)
            return renders and renders * chars(system, turns, tools)

        return await self._thread.run(tok, job, fresh)

    async def expanded(
        self,
        tok: ChatTokenizer,
        renderer: VisionRenderer,
        ids: Sequence[int],
        images: Sequence[PromptImage],
    ) -> VisionPrompt:
        """The template ids ``ids`` with each image token expanded to ``images``' in order
        (an :class:`~gateway.local.vision_prompt.ImageRefused` for one the processor cannot
        take): the renderer's memory, too, is touched on the render thread only."""
        return await self._thread.run(tok, lambda _: renderer.expand(ids, images))

    async def text(self, tok: ChatTokenizer, text: str, add_special_tokens: bool) -> list[int]:
        n = len(text)
        return await self._thread.run(tok, lambda t: t.encode(text, add_special_tokens), lambda: n)

    async def text_prompt(
        self, tok: ChatTokenizer, text: str, shaping: Mapping[str, Any]
    ) -> list[int]:
        """A text completion's prompt as vLLM is handed it (:func:`text_prompt`)."""
        n = len(text)
        return await self._thread.run(tok, lambda t: text_prompt(t, text, shaping), lambda: n)

    def close(self) -> None:
        self._thread.close()


def render(
    tok: ChatTokenizer,
    system: SystemPrompts,
    turns: Turns,
    tools: Tools,
    template: Template = None,
) -> list[int]:
    """The prompt's token ids through the chat template (on the render thread)."""
    # the tools as the log keeps them (canonical JSON), so a rebuilt prompt is the same
    kept = json.loads(canonical_json(tools)) if tools else None
    return chat_prompt(tok, local_messages(system, turns, kept), kept, template)


def chars(system: SystemPrompts, turns: Turns, tools: Tools) -> int:
    """The characters a render of the prompt tokenizes at most, its template's own text
    aside: every system prompt and field of a turn, the tools' JSON (again for each
    turn whose tool changes the template resolves against them)."""
    listed = len(canonical_json(tools)) if tools else 0
    n = sum(map(len, system)) + listed
    for m in turns:
        n += sum(len(v) for v in _texts(m) if v)
        if m.tool_changes is not None:
            n += listed
    return n


def _texts(m: MessageEvent) -> tuple[str | None, ...]:
    return (m.content, m.name, m.tool_calls, m.tool_call_id, m.thinking, m.tool_changes, m.parts)


def _own_template(template: Template) -> bool:
    """A chat template of the request's own: compiled afresh, its cost not bounded."""
    return template is not None and template.get("chat_template") is not None
