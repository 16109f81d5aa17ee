"""The model's own tokenizer and chat template, owned by the gateway.

The gateway renders chat messages to token ids itself and hands those ids to
the engine, so the tokens that end up in the prefix cache are known exactly.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from engines.token_segments import Segments


class _HFTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class ChatTokenizer:
    def __init__(self, hf_tokenizer: _HFTokenizer, name: str) -> None:
        self._tok = hf_tokenizer
        self.name = name
        # a prompt's pieces between added tokens, the long ones tokenized once (False:
        # not built yet; None: this tokenizer cannot be cut so)
        self._segments: Segments | bool | None = False

    @classmethod
    def from_pretrained(cls, path_or_id: str) -> ChatTokenizer:
        from transformers import AutoTokenizer

        hf = cast(_HFTokenizer, AutoTokenizer.from_pretrained(path_or_id))
        return cls(hf, name=path_or_id)

    def clone(self) -> ChatTokenizer:
        """A copy of its own, for another thread (a fast tokenizer is not shared safely)."""
        return ChatTokenizer(copy.deepcopy(self._tok), self.name)

    @property
    def hf(self) -> Any:
        """The Hugging Face tokenizer underneath (for vLLM's tool-call parsers)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Token ids are ``0 <= id < vocab_size`` (added special tokens included)."""
        return len(self._tok)  # type: ignore[arg-type]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``text``'s token ids; ``add_special_tokens``: with the tokenizer's own (a BOS,
        say), as vLLM's text completions tokenize by default."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        generation_prompt: bool = True,
        continue_final: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of ``messages`` (and the ``tools`` the model may call) through the chat
        template: ready for the assistant (``generation_prompt``), or going on with the last
        assistant message (``continue_final``); ``template_kwargs`` are the template's own
        variables (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``);
        ``chat_template``: a template of the request's own instead of the model's;
        ``add_special_tokens``: the rendered text tokenized with the tokenizer's special
        tokens added (vLLM's chat option; the template usually writes them itself)."""
        extra: dict[str, Any] = dict(template_kwargs or {})
        if tools:
            extra["tools"] = list(tools)
        if chat_template is not None:
            extra["chat_template"] = chat_template
        text = self._tok.apply_chat_template(
            list(messages),
            add_generation_prompt=generation_prompt,
            continue_final_message=continue_final,
            tokenize=False,
            **extra,
        )
        if add_special_tokens:  # as HF's own tokenize=True, but with the special tokens
            return self.encode(str(text), add_special_tokens=True)
        return self.encode_rendered(str(text))

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered prompt's ids, as HF's ``apply_chat_template(tokenize=True)`` gives
        them (no special tokens added): cut at the added tokens, the pieces a prompt
        repeats (a system prompt, tools) tokenized once
        (:class:`~engines.token_segments.Segments`) where the tokenizer allows it."""
        if self._segments is False:
            self._segments = Segments.of(self._tok)
        if isinstance(self._segments, Segments):
            return self._segments.encode(text)
        return self.encode(text)


class ThreadCopies:
    """A copy of a tokenizer for each thread that asks for one, made again when the
    tokenizer asked for is another (a restarted engine's): a Hugging Face fast
    tokenizer is not safe to use from two threads at once ("Already borrowed",
    huggingface/tokenizers#537)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, tok: ChatTokenizer) -> ChatTokenizer:
        pair: tuple[ChatTokenizer, ChatTokenizer] | None = getattr(self._local, "pair", None)
        if pair is None or pair[0] is not tok:
            pair = (tok, tok.clone())
            self._local.pair = pair
        return pair[1]
