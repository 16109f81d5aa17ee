"""Background loops of the gateway: a step every few seconds until cancelled."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def every(seconds: float, step: Callable[[], Awaitable[object]], what: str) -> None:
    """Run ``step`` every ``seconds`` until cancelled; a failed step is logged and the
    next one runs on time."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await step()
        except Exception:
            log.exception("%s failed; the next one goes on", what)
