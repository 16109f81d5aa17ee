"""The client's name of a part it sent, for an error about the chat part it became.

Every API's images and documents are served as a chat request's content parts, and
intake names a bad one as chat's ``messages[2].content[1]``; each front-end knows
which of its client's parts each chat part came from (Anthropic's
``messages.1.content.0``, the Responses API's ``input[3].content[1]``, gRPC's
``messages[1].parts[0]``), so the error names the part the client sent.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.core.errors import APIError


def client_named(exc: APIError, names: Mapping[str, str]) -> APIError:
    """``exc`` naming the client's part where it names a part of the chat request the
    client's was served as (intake's ``messages[2].content[1]``): the same error."""
    theirs = names.get(exc.param or "")
    if theirs is None or exc.param is None:
        return exc
    message = exc.message.replace(exc.param, theirs, 1)
    return type(exc)(message, param=theirs, code=exc.code)


def chat_names(offset: int, names: Mapping[int, list[str]]) -> dict[str, str]:
    """Each chat part's name (``messages[i].content[j]``, turns from ``offset``) → the
    client's."""
    return {
        f"messages[{offset + i}].content[{j}]": theirs
        for i, parts in names.items()
        for j, theirs in enumerate(parts)
    }
