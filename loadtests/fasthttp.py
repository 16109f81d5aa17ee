"""Reading a locust ``FastHttpUser`` response as it streams."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def lines(resp: Any) -> Iterator[bytes]:
    """The body line by line, each as soon as it arrives.

    ``iter_content(n)`` waits for n bytes, which would hold back the first
    token; geventhttpclient's parser returns a line once it is complete.
    """
    parser = resp._response  # locust FastResponse -> geventhttpclient response parser
    while True:
        line = parser.readline(b"\n")
        if not line:
            return
        yield line
