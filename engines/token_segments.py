"""A rendered prompt tokenized piece by piece, the long pieces remembered.

A Hugging Face fast tokenizer first cuts its input at the added tokens
(``<|im_start|>``, ``<|im_end|>``, ...) and tokenizes each piece between them on
its own; the ids are the pieces' ids and the added tokens' ids, in order.  So a
chat prompt's system prompt, the same in every request of an application, is
the same piece every time: :class:`Segments` cuts the rendered text the same
way, tokenizes each piece through the tokenizer itself, and remembers the
long ones (least recently used out past a budget of characters).  vLLM's
server tokenizes the whole prompt again each request; here only what is new
(the question) is.

It holds only where cutting first cannot change the ids: every added token
taken as written (not normalized, no stripping of the spaces beside it, not
only as a whole word), special tokens cut out (not encoded as text), and no
Metaspace pre-tokenizer (which treats the first piece of the whole text
apart).  :meth:`Segments.of` returns None for any other tokenizer, and the
caller tokenizes the whole text as before.  Like the tokenizer itself, one
:class:`Segments` is used by one thread at a time.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

Encode = Callable[[str], list[int]]

# pieces of between these lengths are tokenized again each time (mostly new: a
# question); the short ones (the roles' headers, the newlines between turns) and the
# long ones (system prompts, tools, earlier turns) are remembered
SHORT_CHARS = 32
MIN_CHARS = 256
# the remembered pieces' characters (and 64 an entry), at most: ~0.5M tokens, ~22 MB
BUDGET_CHARS = 2_000_000
ENTRY_CHARS = 64


class Segments:
    """Tokenizes text cut at the added tokens, remembering pieces shorter than
    :data:`SHORT_CHARS` or of ``min_chars`` or more (least recently used first out past
    ``budget_chars`` characters in all, counting :data:`ENTRY_CHARS` an entry)."""

    def __init__(
        self,
        added: dict[str, int],
        encode: Encode,
        min_chars: int = MIN_CHARS,
        budget_chars: int = BUDGET_CHARS,
    ) -> None:
        """``added``: each added token's text and id; ``encode``: the tokenizer's own
        encoding of a piece with no added token in it (no special tokens added)."""
        self._added = added
        self._encode = encode
        # leftmost, and the longest at a position (as the tokenizer's own matcher)
        alts = sorted(added, key=len, reverse=True)
        self._cut = re.compile("|".join(re.escape(a) for a in alts)) if alts else None
        self._min = min_chars
        self._budget = budget_chars
        self._memo: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.hits = 0
        self.misses = 0

    @classmethod
    def of(cls, hf: Any, encode: Encode | None = None) -> Segments | None:
        """For ``hf`` (a Hugging Face tokenizer) where cutting first gives the same ids as
        its own tokenizing of the whole text (see the module); None where it may not.
        The pieces are tokenized by its Rust tokenizer itself (``encode``: another way,
        for tests)."""
        backend = getattr(hf, "backend_tokenizer", None)
        if getattr(hf, "split_special_tokens", False) or backend is None:
            return None
        if getattr(backend, "encode_special_tokens", True):
            return None
        pre = backend.pre_tokenizer
        if pre is not None and b"Metaspace" in pre.__getstate__():
            return None
        added: dict[str, int] = {}
        for i, t in backend.get_added_tokens_decoder().items():
            if t.normalized or t.lstrip or t.rstrip or t.single_word:
                return None
            added[t.content] = int(i)

        def piece(text: str) -> list[int]:
            if backend.truncation is not None or backend.padding is not None:
                return list(hf.encode(text, add_special_tokens=False))  # as HF would cut it
            return list(backend.encode(text, add_special_tokens=False).ids)

        return cls(added, encode or piece)

    def encode(self, text: str) -> list[int]:
        """``text``'s ids: each piece between added tokens tokenized (a long one once),
        each added token its id."""
        if self._cut is None:
            return self._piece(text)
        ids: list[int] = []
        at = 0
        for m in self._cut.finditer(text):
            if m.start() > at:
                ids += self._piece(text[at : m.start()])
            ids.append(self._added[m.group()])
            at = m.end()
        if at < len(text):
            ids += self._piece(text[at:])
        return ids

    def _piece(self, piece: str) -> list[int]:
        if SHORT_CHARS <= len(piece) < self._min:
            return self._encode(piece)
        memo = self._memo
        got = memo.get(piece)
        if got is not None:
            memo.move_to_end(piece)
            self.hits += 1
            return list(got)
        self.misses += 1
        ids = self._encode(piece)
        if len(piece) + ENTRY_CHARS <= self._budget:
            memo[piece] = tuple(ids)
            self._chars += len(piece) + ENTRY_CHARS
            while self._chars > self._budget:
                old, _ = memo.popitem(last=False)
                self._chars -= len(old) + ENTRY_CHARS
        return ids
