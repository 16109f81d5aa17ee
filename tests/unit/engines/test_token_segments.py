"""A rendered prompt tokenized piece by piece (engines/token_segments.py): the ids are
the tokenizer's own for the whole text (HF's ``apply_chat_template(tokenize=True)``),
whatever the text, with the long pieces tokenized once; a tokenizer that cannot be
cut so is tokenized whole."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engines.token_segments import Segments
from engines.tokenizer import ChatTokenizer

SYSTEM = "You are the manual of a cache. " + "prefix block hash token evicted " * 60
WORDS = ["cache", "block", " ", "\n", "<|im_end|>", "<|im_start|>", "é", "日本", "  x", "{}", "\t"]


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def hf_ids(tok: ChatTokenizer, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    """The ids as Hugging Face's chat template tokenizes them itself (the oracle)."""
    out = tok.hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kw
    )
    return [int(t) for t in out]


def ask(i: int) -> list[dict[str, Any]]:
    rng = random.Random(i)
    question = "".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 80)))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_the_ids_are_the_tokenizers_own(tokenizer: ChatTokenizer) -> None:
    tok = ChatTokenizer.from_pretrained(tokenizer.name)  # a memory of its own
    for i in range(60):  # questions with special tokens, spaces, unicode, nothing
        assert tok.render_chat(ask(i)) == hf_ids(tok, ask(i)), i
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert tok.render_chat(ask(1), [tool]) == hf_ids(tok, ask(1), tools=[tool])


def test_a_repeated_piece_is_tokenized_once(tokenizer: ChatTokenizer) -> None:
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return tokenizer.encode(text)

    seg = Segments.of(tokenizer.hf, encode)
    assert seg is not None
    question = "why is the prefix cache cold after a restart of the engine?"
    text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
    first, again = seg.encode(text), seg.encode(text)
    assert first == again == tokenizer.encode(text)
    # the system prompt's piece and the short ones ("\n") tokenized once, the next from
    # memory; a question (neither short nor long: mostly new) each time
    system, asked = f"system\n{SYSTEM}", f"user\n{question}"
    assert calls == [system, "\n", asked, asked]
    assert (seg.hits, seg.misses) == (4, 2)  # "\n" twice a prompt


def test_least_recently_used_out_past_the_budget(tokenizer: ChatTokenizer) -> None:
    a, b, c = "a" * 300, "b" * 300, "c" * 300
    seg = Segments({}, tokenizer.encode, budget_chars=2 * (300 + 64))
    seg.encode(a)
    seg.encode(b)
    seg.encode(a)  # used again: b is older
    seg.encode(c)  # past the budget: b goes
    seg.encode(a)
    seg.encode(b)
    assert (seg.hits, seg.misses) == (2, 4)


def test_a_tokenizer_that_cannot_be_cut_is_tokenized_whole(tokenizer: ChatTokenizer) -> None:
    class Fake:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [len(text)]

        def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
            return ""

        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
            return "".join(m["content"] for m in conversation)

    assert Segments.of(Fake(), tokenizer.encode) is None  # no fast backend
    hf = ChatTokenizer.from_pretrained(tokenizer.name).hf
    hf.backend_tokenizer.encode_special_tokens = True  # special tokens read as text
    assert Segments.of(hf, tokenizer.encode) is None
    assert ChatTokenizer(Fake(), "fake").render_chat([{"content": "abc"}]) == [3]
