"""Register the gRPC servicer so that a request that does not decode is INVALID_ARGUMENT.

The generated ``add_GatewayServicer_to_server`` decodes with ``FromString``;
bytes that are not a valid message then fail inside gRPC's own machinery and
the client sees UNKNOWN with a Python class name.  Here each method's
deserializer is lenient (a failure becomes a :class:`Malformed` value) and
the behaviour answers it with INVALID_ARGUMENT and a ``BadRequest`` detail,
like every other client mistake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_status import rpc_status

from gateway.core.errors import InvalidRequest
from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.errors import status_of


class Malformed:
    """What a lenient deserializer returns for bytes that are not the message."""

    def __init__(self, message: str, reason: str) -> None:
        self.message, self.reason = message, reason


def _lenient(cls: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, RuntimeError, ValueError) as exc:  # upb raises DecodeError
            return Malformed(cls.DESCRIPTOR.full_name, str(exc))

    return deserialize


async def _refuse(context: grpc.aio.ServicerContext, bad: Malformed) -> None:
    err = InvalidRequest(
        f"The request is not a valid {bad.message} message ({bad.reason})",
        param="request",
        code="malformed_request",
    )
    await context.abort_with_status(rpc_status.to_status(status_of(err)))


def _unary(behavior: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await _refuse(context, request)
        return await behavior(request, context)

    return run


def _stream(behavior: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[..., Any]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await _refuse(context, request)
            return
        async for item in behavior(request, context):
            yield item

    return run


def add_servicer(servicer: Any, server: grpc.aio.Server, service_name: str) -> None:
    """Every method of ``service_name`` (from the proto's descriptor) on ``servicer``."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for m in pb.DESCRIPTOR.services_by_name[service_name.rsplit(".", 1)[-1]].methods:
        req, resp = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        behavior = getattr(servicer, m.name)
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                _stream(behavior),
                request_deserializer=_lenient(req),
                response_serializer=resp.SerializeToString,
            )
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                _unary(behavior),
                request_deserializer=_lenient(req),
                response_serializer=resp.SerializeToString,
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
