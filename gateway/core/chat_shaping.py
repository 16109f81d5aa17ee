"""vLLM's prompt shaping fields of a chat request, rendered through vcache's own chat
template path (so the engine gets the ids the prediction hashed, and the session log
keeps what renders them again): the template's own variables, the generation prompt,
a continued assistant message and its echo, a request's own template, special tokens."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator

# what the render passes the chat template itself (not a chat_template_kwargs key)
RENDER_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "chat_template",
    }
)


class ChatShaping(BaseModel):
    """A part of every chat completion request."""

    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Annotated[str, Field(min_length=1)] | None = None  # where trusted
    add_special_tokens: bool = False  # vLLM's chat default: the template writes them
    echo: bool = False  # vLLM's: the answer starts with the last message, the assistant's

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_variables_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or {}) & RENDER_VARIABLES)
        if taken:
            raise ValueError(
                f"{', '.join(taken)} cannot be set through chat_template_kwargs (the "
                "request's own fields render them)"
            )
        return v

    def shaping(self) -> dict[str, Any]:
        """These fields where they are not vLLM's defaults (as the session log keeps
        them)."""
        out: dict[str, Any] = {}
        if self.chat_template_kwargs:
            out["chat_template_kwargs"] = self.chat_template_kwargs
        if not self.add_generation_prompt:
            out["add_generation_prompt"] = False
        if self.continue_final_message:
            out["continue_final_message"] = True
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template
        if self.add_special_tokens:
            out["add_special_tokens"] = True
        return out
