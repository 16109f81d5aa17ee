"""Errors raised by engines, translated at the adapter edge.

Every engine adapter turns whatever its backend raises into one of these,
most specific first, also while a stream is being iterated::

    EngineError
    ├── EngineInputError        the request itself is unacceptable (4xx)
    ├── EngineOverloaded        queue full; retry after ``retry_after_s`` (503)
    └── EngineUnavailable       not started, stopped, or dead (503)
        └── EngineGenerationFailed  a request failed inside a live engine (500)
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error an engine adapter raises."""


class EngineInputError(EngineError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloaded(EngineError):
    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(EngineError):
    pass


class EngineGenerationFailed(EngineUnavailable):
    pass
