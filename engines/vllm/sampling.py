"""A request's sampling options as vLLM's ``SamplingParams`` fields, in one place (and
which of its stop strings ended an output, as vLLM reports it).

The embedded engine builds ``SamplingParams(**sampling_fields(s))`` (with its
structured outputs as ``StructuredOutputsParams``); a remote replica's
token-in/token-out endpoint (``/inference/v1/generate``) takes the same
fields as JSON in its ``sampling_params``.  Unset options are left out, so
the engine's own defaults apply as they do for vLLM's server.
"""

from __future__ import annotations

from typing import Any

from engines.base import SamplingOptions


def sampling_fields(s: SamplingOptions) -> dict[str, Any]:
    """``s`` as ``SamplingParams`` keyword arguments, JSON values (structured outputs as
    their field dict, logit bias keyed by token id).  The OpenAI fields always; vLLM's
    extensions only where they differ from ``SamplingParams``' defaults, so vLLM's
    OpenAI server, which fills fields a request leaves out from the model's generation
    config, does so for the same fields on every route."""
    out: dict[str, Any] = {
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "ignore_eos": s.ignore_eos,
    }
    optional: dict[str, Any] = {
        "n": s.n if s.n > 1 else None,
        "top_k": s.top_k or None,
        "seed": s.seed,
        "stop": list(s.stop) or None,
        "logprobs": s.logprobs,
        "prompt_logprobs": s.prompt_logprobs,
        "structured_outputs": s.structured.vllm() if s.structured is not None else None,
        "logit_bias": dict(s.logit_bias) or None,
        "min_p": s.min_p or None,
        "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        "min_tokens": s.min_tokens or None,
        "stop_token_ids": list(s.stop_token_ids) or None,
        "include_stop_str_in_output": s.include_stop_str_in_output or None,
        "skip_special_tokens": None if s.skip_special_tokens else False,
        "spaces_between_special_tokens": None if s.spaces_between_special_tokens else False,
        "bad_words": list(s.bad_words) or None,
        "allowed_token_ids": (
            list(s.allowed_token_ids) if s.allowed_token_ids is not None else None
        ),
        "stream_interval": s.stream_interval,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def stop_string(reason: Any) -> str | None:
    """vLLM's ``stop_reason``: the stop string that matched (an int is a stop token)."""
    return reason if isinstance(reason, str) else None
