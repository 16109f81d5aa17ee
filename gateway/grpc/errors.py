"""gRPC status for an :class:`~gateway.core.errors.APIError`, with ``google.rpc`` details:
``ErrorInfo`` (the code), ``BadRequest`` (the field), ``RetryInfo`` (when to come back)."""

from __future__ import annotations

import math

from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from gateway.core.errors import APIError, Unavailable

_CODES: dict[int, int] = {
    400: code_pb2.INVALID_ARGUMENT,
    401: code_pb2.UNAUTHENTICATED,
    403: code_pb2.PERMISSION_DENIED,
    404: code_pb2.NOT_FOUND,
    413: code_pb2.RESOURCE_EXHAUSTED,
    429: code_pb2.RESOURCE_EXHAUSTED,
    503: code_pb2.UNAVAILABLE,
}
_BUSY = {"queue_full", "engine_overloaded"}  # retryable load shedding: RESOURCE_EXHAUSTED


def status_of(exc: APIError) -> status_pb2.Status:
    code = _CODES.get(exc.status, code_pb2.INTERNAL)
    if isinstance(exc, Unavailable) and exc.code in _BUSY:
        code = code_pb2.RESOURCE_EXHAUSTED
    info = error_details_pb2.ErrorInfo(
        reason=(exc.code or exc.type).upper(),
        domain="vcache",
        metadata={"type": exc.type, **({"param": exc.param} if exc.param else {})},
    )
    status = status_pb2.Status(code=code, message=exc.message)
    status.details.add().Pack(info)
    if exc.param:
        bad = error_details_pb2.BadRequest()
        bad.field_violations.add(field=exc.param, description=exc.message)
        status.details.add().Pack(bad)
    if exc.retry_after_s is not None:
        delay = duration_pb2.Duration(seconds=max(1, math.ceil(exc.retry_after_s)))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status
