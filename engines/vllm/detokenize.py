"""An answer's text made in the engine adapter, once an output, not once a token.

vLLM's output processor detokenizes every token of every request as the engine makes it
(``FastIncrementalDetokenizer``: a ``DecodeStream`` step a token, two decodes each, ~7 µs
in the gateway's process), though the gateway reads an answer once an output: a whole
answer's first token and its last (``SamplingOptions.stream_interval`` covers its
``max_tokens``), a streamed one's every few tokens (``engine.output_interval_ms``).
Where nothing needs the text token by token (no stop strings, no logprobs, no images,
special tokens spaced as vLLM spaces them by default) and the tokenizer's decoder is
byte-level (the text of a run of tokens is the UTF-8 of their bytes), the request is
asked of vLLM with ``detokenize=False`` and :class:`AnswerText` makes the same text
from each output's token ids, one decode an output:

vLLM's stream yields text at each token whose text so far does not end in a
replacement character (a character not yet whole waits for its next bytes, a stray
byte for the next token); at such a token the bytes end on a whole character, from
where UTF-8 decodes the same in one piece as in many.  So an output's text is the
decoding of the tokens since the last such token, up to the last such token in it
(found by decoding shorter runs where the whole one ends in a replacement character),
and the tokens after it wait for the next output.  Where the prompt itself ends within
a character (vLLM's stream starts from the prompt's text), the request keeps vLLM's own
detokenizer, run over each output's ids as vLLM runs it.

A token that ended the answer (EOS, a stop token) is left out of the text unless
``include_stop_str_in_output``, as vLLM leaves it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from engines.base import GenerateRequest

# the prompt's last tokens whose text says whether it ends on a whole character (at most
# 4 bytes; a byte-level token is one or more)
TAIL = 8

REPLACEMENT = "\ufffd"  # what a byte sequence that is not whole UTF-8 decodes to


def byte_level(tokenizer: Any) -> bool:
    """Whether vLLM's tokenizer detokenizes with ``DecodeStream`` over a byte-level decoder."""
    from tokenizers import decoders
    from vllm.v1.engine.detokenizer import uses_fast_detokenizer

    return uses_fast_detokenizer(tokenizer) and isinstance(
        tokenizer._tokenizer.decoder, decoders.ByteLevel
    )


def detokenized_here(request: GenerateRequest) -> bool:
    """Whether nothing in vLLM reads ``request``'s text token by token: no stop string,
    logprob, image or special spacing."""
    s = request.sampling
    return (
        not s.stop
        and s.logprobs is None
        and s.prompt_logprobs is None
        and not request.images
        and (s.skip_special_tokens or s.spaces_between_special_tokens)
    )


class AnswerText:
    """One request's answers' text (``n`` of them, by index), an output at a time."""

    def __init__(self, tokenizer: Any, request: GenerateRequest, params: Any) -> None:
        self._backend = tokenizer  # vLLM's (transformers' TokenizersBackend)
        self._tok = tokenizer._tokenizer  # its tokenizers.Tokenizer
        self._request = request
        self._params = params
        self._skip = request.sampling.skip_special_tokens
        self._include_stop = request.sampling.include_stop_str_in_output
        self._pending: dict[int, list[int]] = {}  # by answer: its ids since its last text
        self._vllms: dict[int, Any] = {}  # by answer, where the prompt ends within a character
        head = self._tok.decode(
            list(request.prompt_token_ids[-TAIL:]), skip_special_tokens=self._skip
        )
        self._whole_start = bool(head) and not head.endswith(REPLACEMENT)

    def add(self, index: int, ids: Sequence[int], done: bool, stop_terminated: bool) -> str:
        """The text answer ``index``'s output of ``ids`` adds (``done``: its last output;
        ``stop_terminated``: its last token is the EOS or stop token that ended it)."""
        ended = done and stop_terminated
        if not self._whole_start or index in self._vllms:
            return self._streamed(index, ids, done, ended)
        shown = ids[:-1] if ended and not self._include_stop and ids else ids
        pending = self._pending.setdefault(index, [])
        pending.extend(shown)
        if not pending:
            return ""
        try:
            n = len(pending)
            text: str = self._tok.decode(pending, skip_special_tokens=self._skip)
            while text.endswith(REPLACEMENT) and n > 0:
                n -= 1
                text = self._tok.decode(pending[:n], skip_special_tokens=self._skip)
        except Exception:  # an id the tokenizer cannot take: vLLM's detokenizer from here
            return self._switch(index, done)
        del pending[:n]
        return text

    def _switch(self, index: int, done: bool) -> str:
        """vLLM's detokenizer for the rest of answer ``index``, from the end of its text
        so far (a whole character, as the prompt's end): first the ids still pending (the
        token that ended the answer left out of them already)."""
        pending = self._pending.pop(index)
        return self._streamed(index, pending, done, False)

    def _streamed(self, index: int, ids: Sequence[int], done: bool, ended: bool) -> str:
        """vLLM's own detokenizer over this output of answer ``index``, as vLLM runs it
        (``ended``: its last id is the token that ended the answer)."""
        d = self._vllm(index)
        d.update(list(ids), ended)
        text: str = d.get_next_output_text(finished=done, delta=True)
        return text

    def _vllm(self, index: int) -> Any:
        d = self._vllms.get(index)
        if d is None:
            from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

            request = SimpleNamespace(
                request_id=self._request.request_id,
                prompt_token_ids=list(self._request.prompt_token_ids),
                sampling_params=self._params,
            )
            d = self._vllms[index] = FastIncrementalDetokenizer(self._backend, request)  # type: ignore[arg-type]
        return d
