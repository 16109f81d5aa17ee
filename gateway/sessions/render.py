"""How a request is rendered from what the session log keeps, live and when rebuilt.

An OpenAI chat request splits into a header (model, target, system prompts,
tools, call config) and turns (:func:`request_parts`, :func:`request_config`);
a text completion's prompt into a header (:func:`text_config`) and the one
entry that is its prompt (:func:`manifest.sessionlog.prompt_entry`), which
:func:`text_prompt` makes the token ids vLLM is handed.
:func:`provider_call` renders those into the provider-neutral call every
provider adapter renders to bytes; :func:`local_messages` and
:func:`vllm_payload` are the local engine's side.  The live paths and
:mod:`gateway.sessions.reconstruct` call the same functions, so a rebuilt
request differs from the sent one only when the log or a renderer is wrong.

A message that carries images or documents keeps them in its event as
references (``MessageEvent.parts``, never the bytes); :func:`provider_call`
resolves each through the attachments resolver it is handed: on the live path
the request's own attachments (:func:`request_attachments`, stored by intake
before the request is journaled), when rebuilt the attachments store, verified,
so a missing or corrupt object fails naming its digest.

The prefix lint runs over the system prompt; under the ``canonical`` layout
the lines it flags (dates, times, ids) move to a volatile part rendered after
the stable one, so the stable part stays a cacheable anchor.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from jinja2 import TemplateError
from pydantic import BaseModel

from engines.lora import LoraRef
from engines.providers.base import (
    Attached,
    CacheDirectives,
    ChatCall,
    ToolCall,
    Turn,
    system_text,
)
from engines.tokenizer import ChatTokenizer
from gateway.core.completion_request import CompletionRequest
from gateway.core.outputs import Usage
from gateway.core.schemas import ChatCompletionRequest, ChatMessage, FilePart, TextPart
from manifest.attachments import Attachment, AttachmentMismatch, AttachmentRef
from manifest.canonical import canonical_json, canonicalize, lint, split_volatile
from manifest.sessionlog import Header, MessageEvent, PartRef, parts_json, parts_of

# an attachment's bytes by its reference: verified, else AttachmentMismatch naming it
Attachments = Callable[[AttachmentRef], Attachment]
# writes a list of ints as json does (digits, ``true``/``false``), ~8x faster: built once,
# it holds no state between calls
_IDS = msgspec.json.Encoder()


def message_parts(m: ChatMessage) -> str | None:
    """A message's content in order as its event keeps it (:func:`parts_json`), when it
    carries an image or a document (intake has taken each in); else None."""
    if not isinstance(m.content, list) or all(isinstance(p, TextPart) for p in m.content):
        return None
    out: list[str | PartRef] = []
    for p in m.content:
        if isinstance(p, TextPart):
            out.append(p.text)
            continue
        if p.attachment is None:
            raise ValueError(f"a {p.type} part that intake has not taken in")
        if isinstance(p, FilePart):
            out.append(PartRef(p.attachment.ref, title=p.file.filename))
        else:
            out.append(PartRef(p.attachment.ref, detail=p.image_url.detail, uuid=p.uuid))
    return parts_json(out)


def request_attachments(req: ChatCompletionRequest) -> Attachments:
    """The live path's resolver: the request's own attachments (already stored)."""
    own = {p.attachment.ref: p.attachment for _, p in req.attachment_parts() if p.attachment}

    def get(ref: AttachmentRef) -> Attachment:
        found = own.get(ref)
        if found is None:
            raise AttachmentMismatch(ref.digest, "not among the request's attachments")
        return found

    return get


def split_messages(
    messages: Sequence[ChatMessage],
) -> tuple[tuple[str, ...], tuple[MessageEvent, ...]]:
    """Leading system/developer messages (the system prompt) and the turns after them
    (tool calls and tool results kept)."""
    msgs = list(messages)
    lead = 0
    while lead < len(msgs) and msgs[lead].role in ("system", "developer"):
        lead += 1
    system = tuple(m.text() for m in msgs[:lead])
    turns = tuple(
        MessageEvent(
            m.role,
            m.text(),
            m.name,
            tool_calls=m.tool_calls_json(),
            tool_call_id=m.tool_call_id,
            thinking=m.thinking,
            tool_changes=m.tool_changes,
            control=m.control,
            parts=message_parts(m),
        )
        for m in msgs[lead:]
    )
    return system, turns


def request_parts(
    req: ChatCompletionRequest,
) -> tuple[tuple[str, ...], tuple[MessageEvent, ...]]:
    return split_messages(req.messages)


def adapter_record(lora: LoraRef | None) -> dict[str, Any]:
    """What a header snapshot and the vLLM payload keep of the LoRA adapter a request
    runs under (the adapter is model-visible): ``{"adapter": {name, path, sha256}}``
    (``sha256``: of its weights files, where the gateway read them); {} for the base
    model, so its headers and payloads stay as they always were."""
    if lora is None:
        return {}
    out: dict[str, Any] = {"name": lora.name, "path": lora.path}
    if lora.sha256 is not None:
        out["sha256"] = lora.sha256
    return {"adapter": out}


def logged_adapter(header: Header) -> LoraRef | None:
    """The adapter a header snapshot says its requests ran under (None: the base model,
    or a header written before adapters were recorded)."""
    a = header.settings().get("adapter")
    if not isinstance(a, Mapping):
        return None
    return LoraRef(str(a["name"]), str(a["path"]), a.get("sha256"))


def request_config(
    req: ChatCompletionRequest, layout: str | None, lora: LoraRef | None = None
) -> dict[str, Any]:
    """The call config a header snapshot keeps (what frames the request, not the turns;
    ``lora``: the adapter it runs under on the local model)."""
    out: dict[str, Any] = {
        "max_tokens": req.output_limit(),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": list(req.stop_list()),
        "seed": req.seed,
        "stream": req.stream,
        "layout": layout,
        "tool_choice": (
            req.tool_choice.model_dump()
            if isinstance(req.tool_choice, BaseModel)
            else req.tool_choice
        ),
    }
    if req.hints.thinking is not None:  # logs written before it have no such key
        out["thinking"] = req.hints.thinking
    if req.hints.effort is not None:
        out["effort"] = req.hints.effort
    if req.hints.omitted_tools:  # hosted tools the model was not shown
        out["omitted_tools"] = list(req.hints.omitted_tools)
    if req.hints.context_management is not None:
        out["context_management"] = req.hints.context_management
    if req.hints.safeguards is not None:
        out["safeguards"] = req.hints.safeguards
    extensions = req.vllm_config()
    if extensions:  # vLLM's sampling extensions, only where a request sets them
        out["vllm"] = extensions
    return out | adapter_record(lora)


@dataclass(frozen=True)
class SystemLayout:
    """A system prompt as rendered: the lint's findings, the stable part, the volatile."""

    findings: tuple[str, ...]  # rule@segment+byte offset
    stable: str | None
    volatile: str | None


def layout_system(system: str | None, canonical: bool) -> SystemLayout:
    """Run the prefix lint over ``system``; under the ``canonical`` layout the lines it
    flags (dates, times, ids) move to the volatile part."""
    if not system:
        return SystemLayout((), None, None)
    findings = lint(canonicalize([], system=system))
    named = tuple(f"{f.rule}@{f.segment_key}+{f.byte_offset}" for f in findings)
    if findings and canonical:
        stable, volatile = split_volatile(system)
        return SystemLayout(named, stable or None, volatile or None)
    return SystemLayout(named, system, None)


class SystemLayouts:
    """:func:`layout_system` remembered per anchor (the last ``size`` system prompts):
    requests sharing a system prompt lint it once."""

    def __init__(self, size: int = 1024) -> None:
        self._size = size
        self._seen: OrderedDict[tuple[str | None, bool], SystemLayout] = OrderedDict()

    def __call__(self, system: str | None, canonical: bool) -> SystemLayout:
        key = (system, canonical)
        hit = self._seen.get(key)
        if hit is not None:
            self._seen.move_to_end(key)
            return hit
        out = self._seen[key] = layout_system(system, canonical)
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return out


def provider_call(
    header: Header,
    turns: Sequence[MessageEvent],
    layouts: Callable[[str | None, bool], SystemLayout] = layout_system,
    attachments: Attachments | None = None,
) -> tuple[ChatCall, list[str]]:
    """The provider-neutral call a header and turns render to (live and when rebuilt);
    the system prompts are joined and laid out by ``layouts``; each attachment a turn
    references is resolved by ``attachments`` (none given: a turn that has one fails
    naming its digest)."""
    cfg = header.settings()
    joined = "\n\n".join(header.system) or None
    laid = layouts(joined, cfg.get("layout") == "canonical")
    system, volatile, named = laid.stable, laid.volatile, list(laid.findings)
    call = ChatCall(
        model=header.target.partition("/")[2],
        turns=tuple(provider_turn(m, attachments) for m in turns),
        system=system,
        volatile_system=volatile,
        tools=tuple(header.tool_list()),
        tool_choice=cfg.get("tool_choice"),
        max_tokens=cfg.get("max_tokens"),
        temperature=cfg.get("temperature"),
        top_p=cfg.get("top_p"),
        stop=tuple(cfg.get("stop") or ()),
        seed=cfg.get("seed"),
        stream=bool(cfg.get("stream", False)),
        thinking=cfg.get("thinking"),
        effort=cfg.get("effort"),
        context_management=cfg.get("context_management"),
        safeguards=cfg.get("safeguards"),
    )
    return call, named


def provider_turn(m: MessageEvent, attachments: Attachments | None = None) -> Turn:
    turn = _provider_turn(m)
    if m.parts is not None:
        turn = dataclasses.replace(turn, parts=turn_parts(m, attachments))
    if m.control is None:
        return turn
    return dataclasses.replace(turn, control=json.loads(m.control))


def turn_parts(m: MessageEvent, attachments: Attachments | None) -> tuple[str | Attached, ...]:
    """A logged message's content in order with each attachment's verified bytes."""
    out: list[str | Attached] = []
    for p in parts_of(m):
        if isinstance(p, str):
            out.append(p)
            continue
        if attachments is None:
            raise AttachmentMismatch(p.ref.digest, "no attachments store to read it from")
        found = attachments(p.ref)
        if found.ref != p.ref:  # a resolver's answer is checked, never trusted
            raise AttachmentMismatch(p.ref.digest, "resolved to another object")
        out.append(Attached(found, p.detail, p.title))
    return tuple(out)


def _provider_turn(m: MessageEvent) -> Turn:
    """A logged turn as the providers' neutral turn: an assistant's tool calls and a tool's
    result kept as such; a system or developer message after the first turn stays a system
    turn where it sits (each adapter renders it as its API allows), with its tool
    changes."""
    if m.role == "assistant":
        calls = tuple(
            ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in json.loads(m.tool_calls or "[]")
        )
        thinking = tuple(json.loads(m.thinking)) if m.thinking else ()
        return Turn("assistant", m.content, calls, thinking=thinking)
    if m.role == "tool":
        found = tuple(json.loads(m.tool_changes)) if m.tool_changes else ()
        return Turn("tool", m.content, tool_call_id=m.tool_call_id, tool_changes=found)
    if m.role in ("system", "developer"):
        changes = tuple(json.loads(m.tool_changes)) if m.tool_changes else ()
        return Turn("system", m.content, tool_changes=changes)
    return Turn("user", m.content)


def directives_of(d: CacheDirectives) -> dict[str, Any]:
    """The cache directives a dispatch event keeps (what the request was rendered with)."""
    out: dict[str, Any] = {
        "breakpoints": list(d.breakpoints),
        "ttl_s": d.ttl_s,
        "cache_key": d.cache_key,
        "cached_content": d.cached_content,
        "warm": d.warm,
    }
    if d.long_ttl:  # logs written before the governor chose tiers have no such key
        out["long_ttl"] = list(d.long_ttl)
    if d.retention:
        out["retention"] = d.retention
    return out


def local_messages(
    system: Sequence[str],
    turns: Sequence[MessageEvent],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The chat-template input: leading system prompts, then the turns (developer →
    system; a system message's tool changes written after its text, the tools it names
    resolved against ``tools``); an assistant's tool calls with their arguments as
    objects, as chat templates expect them."""
    out: list[dict[str, Any]] = [{"role": "system", "content": s} for s in system]
    for m in turns:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        d["content"] = _template_parts(m) if m.parts is not None else m.content
        if m.tool_changes is not None:
            changes = Turn(m.role, m.content, tool_changes=tuple(json.loads(m.tool_changes)))
            d["content"] = system_text(changes, tools or ())
        if m.tool_calls is not None:
            d["tool_calls"] = [_templated_call(c) for c in json.loads(m.tool_calls)]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _template_parts(m: MessageEvent) -> list[dict[str, Any]]:
    """A message with images as a vision model's chat template takes it: its parts in
    order, each image as ``{"type": "image"}`` (the template writes the image token)."""
    out: list[dict[str, Any]] = []
    for p in parts_of(m):
        if isinstance(p, str):
            out.append({"type": "text", "text": p})
        elif p.ref.kind == "image":
            out.append({"type": "image"})
        else:
            raise AttachmentMismatch(p.ref.digest, "a document is not shown to a local model")
    return out


def prompt_images(turns: Sequence[MessageEvent]) -> list[PartRef]:
    """The images of ``turns`` in prompt order (the order of the template's image tokens)."""
    return [p for m in turns for p in parts_of(m) if isinstance(p, PartRef)]


def _templated_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        args: Any = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        args = fn["arguments"]  # not JSON: handed to the template as the text it was
    return {
        "id": call["id"],
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def template_args(template: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's prompt shaping (``ChatCompletionRequest.template``, as the log keeps
    it) as the chat render's arguments."""
    t = template or {}
    return {
        "generation_prompt": bool(t.get("add_generation_prompt", True)),
        "continue_final": bool(t.get("continue_final_message", False)),
        "template_kwargs": t.get("chat_template_kwargs"),
        "chat_template": t.get("chat_template"),
        "add_special_tokens": bool(t.get("add_special_tokens", False)),
    }


def truncated(ids: list[int], keep: int | None, side: str | None = None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: at most ``keep`` tokens of ``ids``, the last
    ones (``side`` "left", the default: the start is cut) or the first ("right")."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep :]


def chat_prompt(
    tok: ChatTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: Mapping[str, Any] | None,
) -> list[int]:
    """The token ids vLLM is handed for a chat: the messages through the chat template
    as the request shaped it, truncated where it asked (the live path and the rebuild
    both come here)."""
    t = template or {}
    shown = offered(tools)
    try:
        ids = tok.render_chat(messages, shown, **template_args(t))
    except TemplateError:
        inline = inline_system(messages)
        if inline == messages:
            raise
        ids = tok.render_chat(inline, shown, **template_args(t))
    return truncated(ids, t.get("truncate_prompt_tokens"), t.get("truncation_side"))


def offered(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools the template lists up front: not the deferred ones (Anthropic's
    ``defer_loading``), which a system message's ``tool_addition`` brings in where it
    sits."""
    kept = [t for t in tools or () if not t.get("defer_loading")]
    return [{k: v for k, v in t.items() if k != "defer_loading"} for t in kept] or None


def inline_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every system message after the first turn written as a user
    message that says what it is (``<system>`` ... ``</system>``): how a model whose chat
    template takes system messages only up front (it raises on one later) sees a
    mid-conversation system message.  The same rule for every request, so a session's
    prompts still extend each other."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    out = messages[:lead]
    for m in messages[lead:]:
        if m["role"] == "system":
            m = {"role": "user", "content": f"<system>\n{m['content']}\n</system>"}
        out.append(m)
    return out


def text_config(req: CompletionRequest, lora: LoraRef | None = None) -> dict[str, Any]:
    """The call config a text completion's header snapshot keeps (what frames it, the
    adapter it runs under included; the sampling vLLM was handed is the dispatch's)."""
    out = {"endpoint": "completions", "stream": req.stream, "echo": req.echo}
    return out | adapter_record(lora)


def text_shaping(
    prompt: str | Sequence[int], add_special_tokens: bool, keep: int | None, side: str | None
) -> dict[str, Any]:
    """How a text completion's prompt becomes its token ids, as the dispatch's ``prompt``
    directive keeps it: a text's special tokens, and the truncation asked for (resolved
    against the context)."""
    out: dict[str, Any] = {}
    if isinstance(prompt, str):
        out["add_special_tokens"] = add_special_tokens
    if keep is not None:
        out["truncate_prompt_tokens"] = keep
        if side is not None:
            out["truncation_side"] = side
    return out


def text_prompt(
    tok: ChatTokenizer, prompt: str | Sequence[int], shaping: Mapping[str, Any]
) -> list[int]:
    """The token ids vLLM is handed for a text completion's prompt: its text tokenized
    (with the tokenizer's special tokens where ``shaping`` says so) or its ids as given,
    truncated where asked (the live path and the rebuild both come here)."""
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_special_tokens=bool(shaping.get("add_special_tokens")))
    else:
        ids = list(prompt)
    return truncated(ids, shaping.get("truncate_prompt_tokens"), shaping.get("truncation_side"))


def vllm_payload(
    token_ids: Sequence[int],
    cache_salt: str | None,
    sampling: Any,
    images: Sequence[str] = (),
    lora: LoraRef | None = None,
    image_uuids: Sequence[str | None] = (),
) -> bytes:
    """What the gateway hands vLLM, as bytes: token ids (a vision model's: expanded),
    cache salt, resolved sampling, where the prompt has images each one's sha256 in
    prompt order (and, when the client named any, each one's uuid or null), and the
    adapter it runs under (:func:`adapter_record`); a base-model, text-only payload is
    as it always was."""
    out: dict[str, Any] = {"cache_salt": cache_salt, "sampling": sampling}
    if images:
        out["images"] = list(images)
    if any(u is not None for u in image_uuids):
        out["image_uuids"] = list(image_uuids)
    return canonical_object(
        out | adapter_record(lora), {"prompt_token_ids": token_ids_json(token_ids)}
    )


def token_ids_json(ids: Sequence[int]) -> bytes:
    """``canonical_json(list(ids))``, the same bytes: a prompt's ids (a thousand and more)
    are most of a vLLM payload, and json's encoder writes them ~8x slower."""
    try:
        return _IDS.encode(ids if isinstance(ids, list | tuple) else list(ids))
    except TypeError:  # not all ints: json's own answer (its error, or its bytes)
        return canonical_json(list(ids))


def canonical_object(fields: Mapping[str, Any], encoded: Mapping[str, bytes]) -> bytes:
    """``canonical_json`` of ``fields`` and ``encoded`` together, where each value of
    ``encoded`` is already its canonical JSON: an object is its members sorted by key,
    each ``key:value``, joined by commas."""
    if fields.keys() & encoded.keys():
        raise ValueError(f"a member twice: {sorted(fields.keys() & encoded.keys())}")
    members = [(k, canonical_json(v)) for k, v in fields.items()] + list(encoded.items())
    members.sort(key=lambda kv: kv[0])
    return b"{" + b",".join(canonical_json(k) + b":" + v for k, v in members) + b"}"


def usage_record(u: Usage) -> dict[str, Any]:
    """What a response event keeps of an answer's usage."""
    d = u.prompt_tokens_details
    return {
        "prompt_tokens": u.prompt_tokens,
        "cached_tokens": d.cached_tokens,
        "cache_write_tokens": d.cache_write_tokens or 0,
        "completion_tokens": u.completion_tokens,
    }
