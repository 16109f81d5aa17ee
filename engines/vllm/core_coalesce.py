"""A request's outputs coalesced in the engine core by its ``stream_interval``.

vLLM's ``SamplingParams.stream_interval`` (N) is applied by its output processor, in
the frontend's process: a request's first token goes out at once, then one output
every N tokens, and the last.  The engine core still sends an ``EngineCoreOutput``
for the request at every step, and the frontend decodes each one and runs it through
its output processor (stats, detokenizer, logprobs) only to hold it back: for an
answer sent whole (N covers its ``max_tokens``) an output a token is decoded and
processed, and two are let through.  The gateway asks for N on every answer sent whole
and on streamed ones where the engine makes several tokens an output interval
(gateway/local/coalesce.py), so vcache's scheduler class applies the same rule where
the outputs are made: each step's output of such a request that carries nothing but
new tokens is held back in the core and its tokens go out with the request's next
output that the rule lets through (the first token, N tokens since the last output
sent, the last token, or an output carrying anything else: events, prefill stats,
logprobs, transfer parameters...).  The frontend then receives the outputs it would
have let through, with the same tokens: what the client sees does not change.

Not coalesced: a request with stop strings (vLLM finds them in the frontend, as it
detokenizes: held tokens would keep the core generating past one), or with sample
logprobs (each step's arrays would need merging); their outputs go out each step, as
under vLLM's own scheduler.  A request finished outside a step (aborted) drops what it
held: nobody reads it.  A preempted request keeps its held tokens until it runs again.

Runs in :class:`~engines.vllm.top_first_scheduler.TopFirstScheduler`'s
``update_from_output`` (before the carried holds' answers are put on the outputs that
go out: engines/vllm/core_holds.py) and ``finish_requests``, on the engine core's thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engines.vllm.core_holds import scheduler_state

STATE = "_vcache_coalesced"  # the scheduler's attribute (:func:`_held`)

# an EngineCoreOutput's fields other than its tokens and its finish that make it go out at
# once (each None, 0 or empty on an output that carries new tokens only).  Its finish is
# read by ``finished``: ``FinishReason.STOP`` is 0, as false as no finish at all
PAYLOAD = (
    "new_logprobs",
    "new_prompt_logprobs_tensors",
    "prompt_token_id_logprobs",
    "pooling_output",
    "events",
    "kv_transfer_params",
    "ec_transfer_params",
    "prefill_stats",
    "routed_experts",
    "mm_cache_miss_hashes",
    "new_sampling_mask",
    "spec_decode_metrics",
)


class Held:
    """A request's tokens held back since its last output sent, and how many make one."""

    __slots__ = ("every", "tokens")

    def __init__(self, every: int) -> None:
        self.every = every
        self.tokens: list[int] = []


def _held(sched: Any) -> dict[str, Held | None]:
    """Per unfinished request that sent its first output: what it holds, or None where
    each of its outputs goes out (:func:`every` is 1), read once a request."""
    return scheduler_state(sched, STATE, dict)  # type: ignore[no-any-return]


def every(request: Any) -> int:
    """The tokens an output of ``request`` carries at least (its ``stream_interval``),
    or 1: each step's output goes out (no interval, stop strings, sample logprobs)."""
    params = getattr(request, "sampling_params", None)
    n = getattr(params, "stream_interval", None)
    if params is None or n is None or n <= 1 or params.stop or params.logprobs is not None:
        return 1
    return int(n)


def _bare(out: Any) -> bool:
    """Whether ``out`` carries new tokens and nothing else (no finish either)."""
    return not out.finished and not any(getattr(out, f, None) for f in PAYLOAD)


def on_outputs(sched: Any, outputs: dict[int, Any]) -> None:
    """Hold back this step's outputs that the rule does not let through; put what was
    held on the output that goes out next."""
    held = _held(sched)
    requests = sched.requests
    emptied = []
    for client, batch in outputs.items():
        if not batch.outputs:
            continue
        kept = []
        for out in batch.outputs:
            rid = out.request_id
            if rid not in held:  # its first output goes out
                if not out.finished:
                    n = every(requests.get(rid))
                    held[rid] = Held(n) if n > 1 else None
                kept.append(out)
                continue
            h = held[rid]
            if h is not None:
                if _bare(out) and len(h.tokens) + len(out.new_token_ids) < h.every:
                    h.tokens.extend(out.new_token_ids)
                    continue
                if h.tokens:
                    out.new_token_ids = h.tokens + list(out.new_token_ids)
                    h.tokens = []
            if out.finished:
                del held[rid]
            kept.append(out)
        batch.outputs = kept
        if not kept and batch.scheduler_stats is None and not batch.finished_requests:
            emptied.append(client)
    for client in emptied:  # nothing left to send that client this step
        del outputs[client]
    if len(held) > len(requests):  # some were freed without a last output or an abort
        for rid in [r for r in held if r not in requests]:
            del held[rid]


def on_finished(sched: Any, request_ids: Iterable[str]) -> None:
    """Requests finished outside a step (aborted): what they held is dropped."""
    held = _held(sched)
    if held:
        for rid in request_ids:
            held.pop(rid, None)
