"""vLLM's request extensions on the OpenAI APIs: the sampling fields the local engine
takes as vLLM's own server does, and the ones vcache refuses by name.

A user moving from ``vllm serve`` sends these in the body (``extra_body`` of the
``openai`` client).  The sampling ones are validated as vLLM validates them and
go to the engine (embedded or remote); hosted-provider targets refuse them with
``unsupported_on_target`` so an alias falls back past them.  Every other vLLM
field vcache does not implement is a 400 naming it when its value is not
vLLM's default — never a silent 200 that does something else.
"""

from __future__ import annotations

import json
from collections.abc import Container
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engines.base import Structured
from gateway.core.errors import InvalidRequest
from manifest.canonical import canonical_json

TokenId = Annotated[int, Field(ge=0)]
MAX_PROMPT_LOGPROBS = (
    20  # vLLM's default max_logprobs  # the upper bound (the vocabulary) is the model's
)

# Known to vLLM's server, not done by vcache: field -> the values that mean "not asked".
_NOT_DONE: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "watermarking": (False,),
    "logprob_token_ids": ([],),
    "prompt_embeds": ([], ""),
    "documents": ([],),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "media_io_kwargs": ({},),
    "mm_processor_kwargs": ({},),
    "return_token_offsets": (False,),
    "return_prompt_text": (False,),
    "thinking_token_budget": (),
    "kv_transfer_params": ({},),
    "vllm_xargs": ({},),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "priority": (0,),
    "session_id": (),  # chat's names the session; text completions keep none
}
_WHY = {
    "priority": "; vcache takes the x-vcache-priority header (interactive, default, batch)",
}


def refuse_not_done(
    data: Any, not_done: dict[str, tuple[Any, ...]], done: Container[str] = ()
) -> None:
    """A 400 naming the first field of ``not_done`` (and not ``done`` by this request
    kind) that ``data`` sets to something other than vLLM's default (None always means
    not asked)."""
    if not isinstance(data, dict):
        return
    for name, defaults in not_done.items():
        value = data.get(name)
        if name in done:
            continue
        if value is not None and not any(value == d for d in defaults):
            raise PydanticCustomError(
                "unsupported_parameter",
                "'{name}' is a vLLM parameter that this gateway does not support{why}",
                {"param": name, "name": name, "why": _WHY.get(name, "")},
            )


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint, and its whitespace options."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    json_object: bool | None = None
    structural_tag: Annotated[str, Field(min_length=1)] | None = None
    disable_any_whitespace: bool | None = None  # None: vcache's compact JSON
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # vLLM's; one backend here, nothing to fall back to

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        kinds = [k for k in _KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            got = ", ".join(kinds) or "none"
            raise PydanticCustomError(
                "value_error",
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                "json_object or structural_tag (got {got})",
                {"param": "structured_outputs", "got": got},
            )
        return self

    @field_validator("json_")
    @classmethod
    def _schema_is_json(cls, v: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        if isinstance(v, str):
            try:
                json.loads(v)
            except ValueError:
                raise ValueError("not a JSON schema (not valid JSON)") from None
        return v

    def structured(self) -> Structured:
        """As the engine's constraint (a schema as canonical JSON text)."""
        schema = self.json_
        if isinstance(schema, str):
            schema = json.loads(schema)
        return Structured(
            json_schema=canonical_json(schema).decode() if schema is not None else None,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=tuple(self.choice) if self.choice is not None else None,
            grammar=self.grammar,
            structural_tag=self.structural_tag,
            any_whitespace=self.disable_any_whitespace is False,
            whitespace_pattern=self.whitespace_pattern,
            no_additional_properties=self.disable_additional_properties,
        )


_KINDS = ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")


class VllmSampling(BaseModel):
    """vLLM's sampling extensions (vllm/sampling_params.py), with its bounds: a part of
    every chat and text completion request."""

    model_config = ConfigDict(extra="ignore")

    top_k: Annotated[int, Field(ge=-1)] | None = None  # 0 or -1: no limit
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's per-request cache isolation, inside the tenant's own (never instead of it)
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # keep at most this many prompt tokens (-1: what the context allows, one token left
    # to generate), cut from the start ("left", vLLM's default) or the end ("right")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # each prompt token's logprob and this many alternatives (a whole answer only)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_PROMPT_LOGPROBS)] | None = None
    return_tokens_as_token_ids: bool = False  # logprob tokens written "token_id:<id>"
    return_token_ids: bool | None = None  # the prompt's and each choice's token ids

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1 (0 keeps nothing)")
        return v

    def prompt_keep(self, max_len: int) -> int | None:
        """How many prompt tokens to keep at most (None: all), or a 400 when the
        context cannot hold that many."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        if keep == -1:
            return max_len - 1
        if keep > max_len:
            raise InvalidRequest(
                f"truncate_prompt_tokens={keep} cannot be greater than the model's maximum "
                f"context length ({max_len})",
                param="truncate_prompt_tokens",
                code="invalid_value",
            )
        return keep

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_done(cls, data: Any) -> Any:
        refuse_not_done(data, _NOT_DONE, cls.model_fields)
        if isinstance(data, dict) and data.get("stream") and data.get("prompt_logprobs"):
            raise PydanticCustomError(
                "value_error",
                "prompt_logprobs are not available when stream is true (vLLM's rule)",
                {"param": "prompt_logprobs"},
            )
        return data

    def vllm_asked(self) -> dict[str, bool]:
        """Each extension: whether this request sets it away from vLLM's default (what
        a target that cannot do it must refuse)."""
        return {
            "top_k": (self.top_k or 0) > 0,
            "min_p": bool(self.min_p),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "min_tokens": self.min_tokens > 0,
            "stop_token_ids": bool(self.stop_token_ids),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": not self.skip_special_tokens,
            "spaces_between_special_tokens": not self.spaces_between_special_tokens,
            "bad_words": bool(self.bad_words),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "structured_outputs": self.structured_outputs is not None,
            "cache_salt": self.cache_salt is not None,
            "truncate_prompt_tokens": self.truncate_prompt_tokens is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "return_tokens_as_token_ids": self.return_tokens_as_token_ids,
            "return_token_ids": bool(self.return_token_ids),
        }

    def vllm_config(self) -> dict[str, Any]:
        """The extensions this request sets, as the session log's header keeps them."""
        asked = self.vllm_asked()
        dumped = self.model_dump(include=set(asked), by_alias=True, exclude_none=True)
        return {k: v for k, v in dumped.items() if asked[k]}
