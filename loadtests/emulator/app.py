"""The emulator application: every provider's routes on one port.

- Anthropic: ``POST /v1/messages`` (``x-api-key``, ``anthropic-version``)
- OpenAI: ``POST /v1/chat/completions``, ``POST /v1/responses`` (Bearer key)
- Gemini: ``POST /v1beta/models/{model}:generateContent`` /
  ``:streamGenerateContent?alt=sse``, ``/v1beta/cachedContents`` (``x-goog-api-key``)
- DeepSeek: ``POST /deepseek/chat/completions`` (base URL ``…/deepseek``)
- batches: OpenAI's ``/v1/files`` and ``/v1/batches``, Anthropic's
  ``/v1/messages/batches`` (:mod:`.openai_batches`, :mod:`.anthropic_batches`; the
  batch's timing and waves: ``/admin/batch-rules``)
- admin: ``/admin/faults``, ``/admin/clock/advance``, ``/admin/flush``,
  ``/admin/requests`` (sha256 of every body received), ``/admin/reset``,
  ``/admin/rules`` (cache rules clients are not told), ``/admin/limits``
  (RPM/TPM), ``/admin/billing`` (tokens by price class, 429s)
"""

from __future__ import annotations

from fastapi import FastAPI

from . import admin, anthropic, anthropic_batches, gemini, openai, openai_batches
from .state import EmulatorState


def create_app(state: EmulatorState | None = None) -> FastAPI:
    app = FastAPI(title="vcache provider emulator")
    app.state.emulator = state or EmulatorState()
    routers = (anthropic.router, anthropic_batches.router, openai.router, openai_batches.router)
    for r in (*routers, gemini.router, admin.router):
        app.include_router(r)
    return app
