"""A chat answer shaped as the Responses API's: the response object and its stream events.

The output holds the assistant's text as one message item (when it wrote
text, or called nothing) and one call item per tool call: ``function_call``
(with its ``namespace`` for a namespace tool's function) or
``custom_tool_call`` (its ``input`` the text), mapped back from the chat
function by :class:`~gateway.service.response_tools.ResponseTools`; its
``call_id`` is the chat call id (so the tool round trip an agent sends back
maps onto the same chat turns the session log keeps).  ``max_tool_calls``
keeps the first calls.  Streamed, each item is added, filled by deltas and
done in turn, as OpenAI's events are (a custom tool's input in one delta, once
its call is whole).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.outputs import ChatCompletion, ToolCallOut, Usage
from gateway.core.pieces import Pieces
from gateway.core.responses_wire import (
    ArgumentsDelta,
    ArgumentsDone,
    CustomInputDelta,
    CustomInputDone,
    Incomplete,
    InputTokensDetails,
    ItemEvent,
    OutputCustomToolCall,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    PartEvent,
    Reasoning,
    ResponseObject,
    ResponsesRequest,
    ResponseState,
    ResponseUsage,
    StreamEvent,
    TextConfig,
    TextDelta,
    TextDone,
)
from gateway.service.response_tools import ResponseTools, custom_input

Status = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(u: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=u.prompt_tokens_details.cached_tokens,
            cache_write_tokens=u.prompt_tokens_details.cache_write_tokens or 0,
        ),
        output_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
    )


def response_object(
    rid: str,
    req: ResponsesRequest,
    created: int,
    output: Sequence[OutputItem] = (),
    finish: str | None = None,
    usage: Usage | None = None,
) -> ResponseObject:
    """The response as the client sees it: in progress until ``finish`` is known."""
    incomplete = finish == "length"
    status = "in_progress" if finish is None else ("incomplete" if incomplete else "completed")
    return ResponseObject(
        id=rid,
        created_at=created,
        status=status,
        incomplete_details=Incomplete(reason="max_output_tokens") if incomplete else None,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=req.model,
        output=list(output),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        store=req.store,
        temperature=req.temperature,
        top_p=req.top_p,
        text=TextConfig(
            format=req.text_format(), verbosity=req.text.verbosity if req.text else None
        ),
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        tools=list(req.tools or []),
        truncation=req.truncation or "disabled",
        metadata=req.metadata or {},
        usage=response_usage(usage) if usage is not None and finish is not None else None,
        reasoning=req.reasoning or Reasoning(),
        max_tool_calls=req.max_tool_calls,
        prompt_cache_key=req.prompt_cache_key,
        safety_identifier=req.safety_identifier,
        user=req.user,
    )


def _message(text: str, finish: str | None) -> OutputMessage:
    status = "incomplete" if finish == "length" else "completed"
    return OutputMessage(id=new_id("msg"), status=status, content=[OutputText(text=text)])


def call_item(
    tools: ResponseTools, chat_name: str, call_id: str, arguments: str, status: Status
) -> OutputFunctionCall | OutputCustomToolCall:
    """The output item of a call of the chat function ``chat_name``."""
    o = tools.origin(chat_name)
    if o.kind == "custom":
        return OutputCustomToolCall(
            id=new_id("ctc"),
            call_id=call_id,
            name=o.name,
            input=custom_input(arguments),
            status=status,
            namespace=o.namespace,
        )
    return OutputFunctionCall(
        id=new_id("fc"),
        call_id=call_id,
        name=o.name,
        arguments=arguments,
        status=status,
        namespace=o.namespace,
    )


def _call(c: ToolCallOut, tools: ResponseTools) -> OutputItem:
    return call_item(tools, c.function.name, c.id, c.function.arguments, "completed")


def output_items(
    done: ChatCompletion, tools: ResponseTools, max_calls: int | None = None
) -> list[OutputItem]:
    """A whole chat answer's output items: its text, then its tool calls (the first
    ``max_calls``)."""
    msg = done.choices[0].message
    calls = (msg.tool_calls or [])[:max_calls]
    items: list[OutputItem] = []
    if msg.content or not calls:
        items.append(_message(msg.content or "", done.choices[0].finish_reason))
    items += [_call(c, tools) for c in calls]
    return items


@dataclass
class _Open:
    """An output item being streamed."""

    index: int
    item: OutputItem
    parts: list[str] = field(default_factory=list)


@dataclass
class ResponseStream:
    """The events of one streamed response; ``seq`` is the next sequence number (an error
    event after a failure carries it too)."""

    rid: str
    req: ResponsesRequest
    created: int
    tools: ResponseTools = field(default_factory=ResponseTools)
    seq: int = 0
    items: list[OutputItem] = field(default_factory=list)
    finish: str | None = None
    usage: Usage | None = None

    def n(self) -> int:
        self.seq += 1
        return self.seq - 1

    def final(self) -> ResponseObject:
        return response_object(
            self.rid, self.req, self.created, self.items, self.finish or "stop", self.usage
        )

    async def events(self, pieces: Pieces) -> AsyncGenerator[list[StreamEvent], None]:
        """Every event through ``response.completed`` (or ``incomplete``), but the last:
        the caller stores the response first, then sends :meth:`final`.  Yields the
        events of one piece together (the response's start with the first piece's, the
        items' closing ones with the last's): they are made at once, and go out in one
        write."""
        pending = response_object(self.rid, self.req, self.created)
        out: list[StreamEvent] = [
            ResponseState(type="response.created", sequence_number=self.n(), response=pending),
            ResponseState(type="response.in_progress", sequence_number=self.n(), response=pending),
        ]
        cur: _Open | None = None
        calls: dict[int, _Open] = {}
        async with aclosing(pieces):
            async for p in pieces:
                if p.text and p.index == 0:
                    if cur is None or not isinstance(cur.item, OutputMessage):
                        out += self._close(cur)
                        cur = _Open(
                            len(self.items), OutputMessage(id=new_id("msg"), status="in_progress")
                        )
                        out += self._opened(cur)
                    cur.parts.append(p.text)
                    out.append(self._delta(TextDelta, cur, p.text))
                for tc in p.tool_calls if p.index == 0 else ():
                    if tc.index not in calls:
                        if len(calls) == self.req.max_tool_calls:
                            continue  # past max_tool_calls: not an output item
                        out += self._close(cur)
                        item = call_item(
                            self.tools,
                            tc.name or "",
                            tc.id or new_id("call"),
                            "",
                            "in_progress",
                        )
                        cur = calls[tc.index] = _Open(len(self.items), item)
                        out += self._opened(cur)
                    o = calls[tc.index]
                    if tc.arguments:
                        o.parts.append(tc.arguments)
                        if isinstance(o.item, OutputCustomToolCall):
                            continue  # its input is sent whole when the call is
                        out.append(self._delta(ArgumentsDelta, o, tc.arguments))
                if p.index == 0:
                    self.finish = p.finish_reason or self.finish
                self.usage = p.usage or self.usage
                if p.usage is None and out:  # the last piece's go with the closing events
                    yield out
                    out = []
        if cur is None:  # nothing written, nothing called: an empty message
            cur = _Open(0, OutputMessage(id=new_id("msg"), status="in_progress"))
            out += self._opened(cur)
        out += self._close(cur)
        yield out

    def _delta(
        self, kind: type[TextDelta] | type[ArgumentsDelta], o: _Open, text: str
    ) -> TextDelta | ArgumentsDelta:
        """The next piece of ``o``'s text (a message's) or arguments (a call's)."""
        return kind(sequence_number=self.n(), item_id=o.item.id, output_index=o.index, delta=text)

    def _opened(self, o: _Open) -> list[StreamEvent]:
        self.items.append(o.item)
        out: list[StreamEvent] = [
            ItemEvent(
                type="response.output_item.added",
                sequence_number=self.n(),
                output_index=o.index,
                item=o.item.model_copy(),
            )
        ]
        if isinstance(o.item, OutputMessage):
            out.append(
                PartEvent(
                    type="response.content_part.added",
                    sequence_number=self.n(),
                    item_id=o.item.id,
                    output_index=o.index,
                    part=OutputText(text=""),
                )
            )
        return out

    def _close(self, o: _Open | None) -> list[StreamEvent]:
        if o is None:
            return []
        text = "".join(o.parts)
        status = "incomplete" if self.finish == "length" else "completed"
        out: list[StreamEvent] = []
        done: OutputItem
        if isinstance(o.item, OutputMessage):
            part = OutputText(text=text)
            done = o.item.model_copy(update={"status": status, "content": [part]})
            out += [
                TextDone(
                    sequence_number=self.n(), item_id=o.item.id, output_index=o.index, text=text
                ),
                PartEvent(
                    type="response.content_part.done",
                    sequence_number=self.n(),
                    item_id=o.item.id,
                    output_index=o.index,
                    part=part,
                ),
            ]
        elif isinstance(o.item, OutputCustomToolCall):
            given = custom_input(text)
            done = o.item.model_copy(update={"status": "completed", "input": given})
            out += [
                CustomInputDelta(
                    sequence_number=self.n(),
                    item_id=o.item.id,
                    output_index=o.index,
                    delta=given,
                ),
                CustomInputDone(
                    sequence_number=self.n(),
                    item_id=o.item.id,
                    output_index=o.index,
                    input=given,
                ),
            ]
        else:
            done = o.item.model_copy(update={"status": "completed", "arguments": text})
            out.append(
                ArgumentsDone(
                    sequence_number=self.n(),
                    item_id=o.item.id,
                    output_index=o.index,
                    name=o.item.name,
                    arguments=text,
                )
            )
        self.items[o.index] = done
        out.append(
            ItemEvent(
                type="response.output_item.done",
                sequence_number=self.n(),
                output_index=o.index,
                item=done,
            )
        )
        return out
