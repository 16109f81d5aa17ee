"""The text of an answer sent whole, decoded once from its token ids at its end.

vLLM's output processor detokenizes every token of every request as the engine makes it
(``FastIncrementalDetokenizer``: a ``DecodeStream`` step a token, two decodes of the
tokens since its last whole character, ~7 µs in the gateway's process), though an answer
the client takes whole has its text read once, from its last output (its outputs are its
first token and its last: ``SamplingOptions.stream_interval`` covers its
``max_tokens``).  Where nothing needs the text as it grows (no stop strings, no
logprobs, no images, special tokens spaced as vLLM spaces them by default) and the
tokenizer's decoder is byte-level (the text of a run of tokens is the UTF-8 of their
bytes, so decoding is the same in one piece as in many), such an answer is asked of vLLM
with ``detokenize=False`` and its text made here, at its end:

- the answer's ids decoded once after the prompt's last tokens, the text past the
  prompt's, up to its last token whose text so far does not end in a replacement
  character: vLLM's stream yields text at each token whose text does not (a character
  not yet whole waits for its next bytes, a stray byte for the next token), and where a
  token's does, the text up to it is the decoding of the bytes up to it, one piece or
  many alike (UTF-8 resynchronizes at every whole character);
- where the prompt itself ends within a character, vLLM's own detokenizer, run over the
  ids as vLLM would have run it.

A token that ended the answer (EOS, a stop token) is left out of the text unless
``include_stop_str_in_output``, as vLLM leaves it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from engines.base import GenerateRequest

# the prompt's last tokens the answer is decoded after: enough bytes for its last
# character (at most 4 bytes; a byte-level token is one or more)
TAIL = 8

REPLACEMENT = "\ufffd"  # what a byte sequence that is not whole UTF-8 decodes to


def byte_level(tokenizer: Any) -> bool:
    """Whether vLLM's tokenizer detokenizes with ``DecodeStream`` over a byte-level decoder."""
    from tokenizers import decoders
    from vllm.v1.engine.detokenizer import uses_fast_detokenizer

    return uses_fast_detokenizer(tokenizer) and isinstance(
        tokenizer._tokenizer.decoder, decoders.ByteLevel
    )


def decoded_once(request: GenerateRequest) -> bool:
    """Whether ``request``'s text can wait for its end: an answer sent whole that no stop
    string, logprob, image or special spacing reads as it grows."""
    s = request.sampling
    whole = s.stream_interval is not None and s.stream_interval >= s.max_tokens
    return (
        whole
        and not s.stop
        and s.logprobs is None
        and s.prompt_logprobs is None
        and not request.images
        and (s.skip_special_tokens or s.spaces_between_special_tokens)
    )


class WholeText:
    """One request's answers (``n`` of them, by index), their ids gathered as they come,
    each one's text made when it ends."""

    def __init__(self, tokenizer: Any, request: GenerateRequest, params: Any) -> None:
        self._backend = tokenizer  # vLLM's (transformers' TokenizersBackend)
        self._tok = tokenizer._tokenizer  # its tokenizers.Tokenizer
        self._prompt = request.prompt_token_ids
        self._request_id = request.request_id
        self._params = params
        self._skip = request.sampling.skip_special_tokens
        self._include_stop = request.sampling.include_stop_str_in_output
        self._ids: dict[int, list[int]] = {}

    def add(self, index: int, ids: Sequence[int], done: bool, stop_terminated: bool) -> str:
        """The text of answer ``index`` so far: "" until it is ``done``, then all of it
        (``stop_terminated``: its last token is the EOS or stop token that ended it)."""
        got = self._ids.setdefault(index, [])
        got.extend(ids)
        if not done:
            return ""
        return self.text(got, stop_terminated)

    def text(self, ids: Sequence[int], stop_terminated: bool) -> str:
        """The text vLLM's detokenizer makes of an answer of ``ids``."""
        shown = list(ids[:-1] if stop_terminated and not self._include_stop and ids else ids)
        tail = list(self._prompt[-TAIL:])
        try:
            head = self._tok.decode(tail, skip_special_tokens=self._skip)
            if not head or head.endswith(REPLACEMENT):  # the prompt ends within a character
                return self._streamed(ids, stop_terminated)
            text: str = self._tok.decode([*tail, *shown], skip_special_tokens=self._skip)
            if not text.startswith(head):
                return self._streamed(ids, stop_terminated)
            # the stream yields nothing past its last token whose text did not end in a
            # replacement character (a character not yet whole, or a stray byte)
            n = len(shown)
            while text.endswith(REPLACEMENT) and n > 0:
                n -= 1
                text = self._tok.decode([*tail, *shown[:n]], skip_special_tokens=self._skip)
            return text[len(head) :]
        except Exception:  # an id the tokenizer cannot take: as vLLM's detokenizer takes it
            return self._streamed(ids, stop_terminated)

    def _streamed(self, ids: Sequence[int], stop_terminated: bool) -> str:
        """vLLM's own detokenizer over ``ids``, token by token, as it runs in vLLM."""
        from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

        request = SimpleNamespace(
            request_id=self._request_id,
            prompt_token_ids=list(self._prompt),
            sampling_params=self._params,
        )
        detokenizer = FastIncrementalDetokenizer(self._backend, request)  # type: ignore[arg-type]
        detokenizer.update(list(ids), stop_terminated)
        return detokenizer.get_next_output_text(finished=True, delta=False)
