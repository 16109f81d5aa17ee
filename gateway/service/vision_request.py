"""A chat request's images for the local vision-language model: its image parts checked
(a document, or any attachment when the model reads text only, is a 400 naming the
part), expanded into the template ids as vLLM's processor expands them
(:class:`~gateway.local.vision_prompt.VisionRenderer`, on the render thread), and handed
to the engine each with its span.
"""

from __future__ import annotations

from engines.base import EngineImage
from engines.tokenizer import ChatTokenizer
from gateway.core.errors import InvalidRequest
from gateway.core.schemas import ChatCompletionRequest, FilePart, ImageUrlPart
from gateway.local.vision_prompt import ImageRefused, PromptImage, VisionPrompt, VisionRenderer
from gateway.service.prompts import Prompts


async def expanded_prompt(
    req: ChatCompletionRequest,
    ids: list[int],
    vision: VisionRenderer | None,
    prompts: Prompts,
    tok: ChatTokenizer,
) -> VisionPrompt | None:
    """``ids`` (the template's) with the request's images expanded as vLLM's processor
    expands them (None: no image); a document, or an image the processor cannot take,
    is a 400 naming its part.  ``vision`` None: the model reads text only."""
    named = list(req.attachment_parts())
    if not named:
        return None
    blind = named[0][0] if vision is None else None
    blind = blind or next((w for w, p in named if isinstance(p, FilePart)), None)
    if blind is not None or vision is None:
        where = blind or named[0][0]
        reads = "text only" if vision is None else "text and images only"
        raise InvalidRequest(
            f"{where}: the local model reads {reads} (documents go to a target that sees them)",
            param=where,
            code="unsupported_on_target",
        )
    images: list[PromptImage] = []
    for where, part in named:
        a = part.attachment
        if a is None or a.ref.width is None or a.ref.height is None:
            raise InvalidRequest(f"{where}: the image was not taken in", param=where)
        uuid = part.uuid if isinstance(part, ImageUrlPart) else None
        images.append(PromptImage(a.data, a.ref.width, a.ref.height, uuid))
    try:
        return await prompts.expanded(tok, vision, ids, images)
    except ImageRefused as exc:
        where = named[min(exc.index, len(named) - 1)][0]
        raise InvalidRequest(
            f"{where}: the local model cannot take this image: {exc}",
            param=where,
            code="invalid_attachment",
        ) from exc


def engine_images(req: ChatCompletionRequest, vp: VisionPrompt) -> tuple[EngineImage, ...]:
    """The request's images as the engine is handed them, each with its span."""
    out: list[EngineImage] = []
    for (_, part), span in zip(req.attachment_parts(), vp.spans, strict=True):
        a = part.attachment
        assert a is not None  # expanded: every image was taken in
        uuid = part.uuid if isinstance(part, ImageUrlPart) else None
        out.append(
            EngineImage(a.data, a.ref.media_type, span.identifier, uuid, span.offset, span.length)
        )
    return tuple(out)
