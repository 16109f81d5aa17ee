"""The text completion request (``POST /v1/completions``): one prompt or several, and
what OpenAI and vLLM take with them (echo, return_token_ids; best_of refused)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gateway.core.schemas import MAX_N, SamplingFields, TokenId

MAX_PROMPTS = 128  # prompts in one text completion request


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None

    best_of: int | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: with echo, score the prompt
    add_special_tokens: bool = True  # vLLM's default for text: the tokenizer's BOS, say

    @model_validator(mode="before")
    @classmethod
    def _a_prompt(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("prompt") in (None, "", []):
            raise PydanticCustomError(
                "value_error",
                "Either prompt or prompt_embeds must be provided and non-empty.",
                {"param": "prompt"},
            )
        return data

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, v: str | list[str] | list[TokenId] | list[list[TokenId]]
    ) -> str | list[str] | list[TokenId] | list[list[TokenId]]:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], str | list) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v > 1:
            raise PydanticCustomError(
                "unsupported_parameter",
                "best_of is not supported (nor by vLLM 0.32): ask for n samples",
                {"param": "best_of"},
            )
        return v

    @model_validator(mode="after")
    def _choices_fit(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError(
                "value_error",
                "max_tokens 0 needs echo (the prompt scored, nothing generated)",
                {"param": "max_tokens"},
            )
        if self.n * self.prompt_count() > MAX_N * 8:
            raise PydanticCustomError(
                "value_error",
                "n times the number of prompts is at most {most}",
                {"param": "n", "most": MAX_N * 8},
            )
        return self

    def prompt_count(self) -> int:
        p = self.prompt
        return len(p) if isinstance(p, list) and isinstance(p[0], str | list) else 1

    def prompt_logprobs_asked(self) -> int | None:
        """How many alternatives per prompt token the engine computes: as asked, or
        (echo with logprobs) as many as the answer's own tokens get."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


@dataclass(frozen=True)
class TextPrompt:
    """One prompt of a text completion, as one engine request serves it: the request (its
    sampling, echo, truncation) and the prompt (a text, or token ids), with the parameter
    that names it in an error (``prompt``, ``prompt[2]``)."""

    request: CompletionRequest = field(repr=False)
    prompt: str | list[int] = field(repr=False)  # prompts never reach logs
    param: str = "prompt"

    @property
    def model(self) -> str:
        return self.request.model
