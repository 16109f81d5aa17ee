"""Logprobs in each API's shape: chat's per-token objects, text completion's parallel
lists (the legacy shape, echoed prompt tokens first when asked), and vLLM's
``prompt_logprobs`` maps.  With vLLM's ``return_tokens_as_token_ids`` a token is
written ``token_id:<id>`` (where the engine gave the id), so a client can tell apart
tokens that decode to the same text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.base import LOGPROB_FLOOR, TokenLogprob
from gateway.core.outputs import ChoiceLogprobs, CompletionLogprobs, TokenLogprobOut, TopLogprob


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", "replace"))


def _name(token: str, token_id: int | None, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids and token_id is not None else token


def _tops(t: TokenLogprob, as_ids: bool) -> list[tuple[str, float]]:
    ids: Sequence[int | None] = t.top_ids if len(t.top_ids) == len(t.top) else [None] * len(t.top)
    return [(_name(tok, i, as_ids), lp) for (tok, lp), i in zip(t.top, ids, strict=True)]


def chat_logprobs(lps: Sequence[TokenLogprob], as_ids: bool = False) -> ChoiceLogprobs:
    content = []
    for t in lps:
        token = _name(t.token, t.token_id, as_ids)
        content.append(
            TokenLogprobOut(
                token=token,
                logprob=LOGPROB_FLOOR if t.logprob is None else t.logprob,
                bytes=_utf8(t.token),
                top_logprobs=[
                    TopLogprob(token=a, logprob=b, bytes=_utf8(a)) for a, b in _tops(t, as_ids)
                ],
            )
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    lps: Sequence[TokenLogprob], offset: int, as_ids: bool = False
) -> CompletionLogprobs:
    """The legacy shape; ``offset``: where the first token starts in the choice's text.
    An echoed prompt's first token has no logprob (None, as OpenAI and vLLM write it)."""
    out = CompletionLogprobs()
    for t in lps:
        token = _name(t.token, t.token_id, as_ids)
        out.tokens.append(token)
        out.token_logprobs.append(t.logprob)
        if t.logprob is None:
            out.top_logprobs.append(None)
        else:
            top = {token: t.logprob}  # the sampled token first, always among them (vLLM's)
            for name, lp in _tops(t, as_ids):
                top.setdefault(name, lp)
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(t.token)
    return out


def prompt_logprobs(entries: Sequence[TokenLogprob | None]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {id: {logprob,
    rank, decoded_token}} holding the token itself and the top alternatives."""
    out: list[dict[str, Any] | None] = []
    for t in entries:
        if t is None or t.token_id is None:
            out.append(None)
            continue
        step: dict[str, Any] = {}
        for rank, ((tok, lp), i) in enumerate(zip(t.top, t.top_ids, strict=False), start=1):
            step[str(i)] = {"logprob": lp, "rank": rank, "decoded_token": tok}
        step[str(t.token_id)] = {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.token}
        out.append(step)
    return out
