"""Server-sent events for streamed completions, with errors mid-stream in OpenAI's shape."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gateway.core.errors import APIError

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def _event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


async def open_stream(
    stream: AsyncGenerator[BaseModel, None], headers: dict[str, str] | None = None
) -> StreamingResponse:
    """Start ``stream`` now and return the response.

    The first item is awaited here, so an error before it (unknown model, full
    queue, prompt too long) is raised to the caller and becomes a normal HTTP
    error, not a 200 with an error inside.  When the client goes away, the
    response task is cancelled inside ``stream``, which aborts the engine request.
    """
    first = await anext(stream)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield _event(first.model_dump_json().encode())
            async for item in stream:
                yield _event(item.model_dump_json().encode())
        except APIError as exc:
            log.warning("stream failed after it started: %s", exc.message)
            yield _event(json.dumps(exc.body()).encode())
            return
        finally:
            await stream.aclose()
        yield DONE

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )
