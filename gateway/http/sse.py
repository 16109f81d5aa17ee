"""Server-sent events for streamed answers, with errors mid-stream in the API's shape."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Send

from gateway.core.errors import APIError

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def _event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def openai_frame(item: BaseModel) -> bytes:
    return _event(item.model_dump_json().encode())


def named_frame(item: BaseModel) -> bytes:
    """An event named by the item's ``type`` (Anthropic's and the Responses API's streams)."""
    kind = str(getattr(item, "type", "message"))
    return b"event: " + kind.encode() + b"\ndata: " + item.model_dump_json().encode() + b"\n\n"


def openai_error(exc: APIError) -> bytes:
    return _event(json.dumps(exc.body()).encode())


class EventStream(StreamingResponse):
    """A stream of events whose closing bytes (``tail``: OpenAI's ``[DONE]``, once the
    stream ended well) go out with the chunked body's end, in one write, not two."""

    tail = b""

    async def stream_response(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": self.tail, "more_body": False})


async def open_stream(
    stream: AsyncGenerator[Sequence[BaseModel], None],
    headers: dict[str, str] | None = None,
    frame: Callable[[BaseModel], bytes] = openai_frame,
    on_error: Callable[[APIError], bytes] = openai_error,
    done: bytes | None = DONE,
) -> StreamingResponse:
    """Start ``stream`` now and return the response: each item ``stream`` yields, the
    events of one piece of the answer (made at once), goes out in one write.

    The first item is awaited here, so an error before it (unknown model, full
    queue, prompt too long) is raised to the caller and becomes a normal HTTP
    error, not a 200 with an error inside.  When the client goes away, the
    response task is cancelled inside ``stream``, which aborts the engine request.
    """
    first = await anext(stream)

    def framed(events: Sequence[BaseModel]) -> bytes:
        return b"".join(map(frame, events))

    async def body() -> AsyncIterator[bytes]:
        try:
            yield framed(first)
            async for item in stream:
                yield framed(item)
        except APIError as exc:
            log.warning("stream failed after it started: %s", exc.message)
            yield on_error(exc)
            return
        finally:
            await stream.aclose()
        if done is not None:
            response.tail = done  # sent with the body's end

    response = EventStream(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )
    return response
