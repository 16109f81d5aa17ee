"""The gRPC edge: ``vcache.v1.Gateway`` over the same service core as HTTP.

Requests are converted to the HTTP API's pydantic models (so validation is
identical), handed to :class:`GatewayService` / :class:`CacheService`, and
answered in proto.  A message's ``parts`` (text, images and documents in
order, their bytes as sent) become chat's content parts, an image's or a
document's bytes a data URL of exactly those bytes, so the one intake reads
them as it reads HTTP's.  Errors become a status with details: ``BadRequest``
naming the field, ``ErrorInfo`` with the error code, ``RetryInfo`` when the
client should come back.  A cancelled call or an expired deadline cancels
the handler, which aborts its engine request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from pydantic import BaseModel, ValidationError

from gateway.core.completion_request import CompletionRequest
from gateway.core.errors import APIError, InvalidRequest, invalid_request_from
from gateway.core.outputs import Usage
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.types import Principal, Served
from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.api import gateway_pb2_grpc as pb_grpc
from gateway.grpc.errors import status_of
from gateway.grpc.register import add_servicer
from gateway.service.auth import KeyRing
from gateway.service.cache import CacheRequest, CacheService
from gateway.service.chat import GatewayService
from gateway.service.part_names import client_named
from manifest.attachments import data_url

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Gateway"].full_name
M = TypeVar("M", bound=BaseModel)
P = TypeVar("P")


def _validate(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_request_from(exc.errors()) from exc


def _sampling(s: pb.SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "ignore_eos": s.ignore_eos,
    }
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if s.HasField(name):
            out[name] = getattr(s, name)
    if s.stop:
        out["stop"] = list(s.stop)
    if s.user:
        out["user"] = s.user
    return out


def _part(p: pb.ContentPart, where: str) -> dict[str, Any]:
    """One content part in chat's shape."""
    kind = p.WhichOneof("part")
    if kind == "text":
        return {"type": "text", "text": p.text}
    if kind == "image":
        img = p.image
        if bool(img.data) == bool(img.url):
            raise InvalidRequest(f"{where}.image: give data or url, one of them", param=where)
        url = img.url or data_url(img.media_type, img.data)
        image_url = {"url": url, "detail": img.detail or None}
        part: dict[str, Any] = {"type": "image_url", "image_url": image_url}
        if img.uuid:
            part["uuid"] = img.uuid
        return part
    if kind == "document":
        doc = p.document
        file = {"file_data": data_url(doc.media_type, doc.data), "filename": doc.filename or None}
        return {"type": "file", "file": file}
    raise InvalidRequest(f"{where}: an empty content part", param=where)


def _part_names(ms: Any) -> dict[str, str]:
    """Each chat part's name → the request's (``messages[1].parts[0]``)."""
    return {
        f"messages[{i}].content[{j}]": f"messages[{i}].parts[{j}]"
        for i, m in enumerate(ms)
        for j in range(len(m.parts))
    }


def _messages(ms: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(ms):
        content: Any = m.content
        if m.parts:
            if m.content:
                raise InvalidRequest(
                    f"messages[{i}]: content and parts are exclusive", param=f"messages[{i}]"
                )
            content = [_part(p, f"messages[{i}].parts[{j}]") for j, p in enumerate(m.parts)]
        out.append({"role": m.role, "content": content, **({"name": m.name} if m.name else {})})
    return out


def _usage(u: Usage | None, served: Served) -> pb.Usage:
    d = served.dispatch
    out = pb.Usage(target=served.target, replica=d.replica_id if d is not None else "")
    if u is not None:
        out.prompt_tokens = u.prompt_tokens
        out.completion_tokens = u.completion_tokens
        out.total_tokens = u.total_tokens
        out.cached_tokens = u.prompt_tokens_details.cached_tokens
    if d is not None and d.predicted_cached_tokens is not None:
        out.predicted_cached_tokens = d.predicted_cached_tokens
        out.prediction = "approximate" if d.approximate else "exact"
        out.prediction_cause = d.approximate
    return out


CacheRpc = Callable[["GatewayServicer", pb.CacheRequest, grpc.aio.ServicerContext], Awaitable[Any]]


def _cache_rpc(operation: str, response: Callable[[], Any]) -> CacheRpc:
    """The servicer method of one cache operation (``CacheService.<operation>``)."""

    async def rpc(
        self: GatewayServicer, request: pb.CacheRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        op = getattr(self._cache_service, operation)
        return await self._admin(
            context, lambda who: op(self._cache_request(request), who), response()
        )

    rpc.__name__ = operation.capitalize()
    return rpc


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(
        self,
        service: GatewayService,
        keyring: KeyRing,
        cache: CacheService,
    ) -> None:
        self._svc = service
        self._keys = keyring
        self._cache_service = cache

    # ------------------------------------------------------------ plumbing

    async def _fail(self, context: grpc.aio.ServicerContext, exc: APIError) -> None:
        await context.abort_with_status(rpc_status.to_status(status_of(exc)))

    def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        md = dict(context.invocation_metadata() or ())
        auth, priority = md.get("authorization"), md.get("x-vcache-priority")
        return self._keys.authenticate(
            auth if isinstance(auth, str) else None,
            priority if isinstance(priority, str) else None,
        )

    def _chat_request(
        self, request: pb.ChatCompletionRequest, stream: bool
    ) -> ChatCompletionRequest:
        data: dict[str, Any] = {
            "model": request.model,
            "messages": _messages(request.messages),
            **_sampling(request.sampling),
            "stream": stream,
        }
        if stream:
            data["stream_options"] = {"include_usage": True}
        return _validate(ChatCompletionRequest, data)

    def _cache_request(self, request: pb.CacheRequest) -> CacheRequest:
        data: dict[str, Any] = {"model": request.model}
        source = request.WhichOneof("source")
        if source == "messages":
            data["messages"] = _messages(request.messages.messages)
        elif source == "prompt":
            data["prompt"] = request.prompt
        elif source == "token_ids":
            data["token_ids"] = list(request.token_ids.ids)
        elif source == "block_hashes":
            data["block_hashes"] = list(request.block_hashes.hex)
        if request.replica:
            data["replica"] = request.replica
        if request.tenant:
            data["tenant"] = request.tenant
        if request.HasField("lease_s"):
            data["lease_s"] = request.lease_s
        return _validate(CacheRequest, data)

    # --------------------------------------------------------- completions

    async def ChatCompletion(
        self, request: pb.ChatCompletionRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChatCompletionResponse:
        try:
            who = self._principal(context)
            done = await self._svc.chat(self._chat_request(request, stream=False), who)
        except APIError as exc:
            await self._fail(context, client_named(exc, _part_names(request.messages)))
            raise AssertionError("unreachable") from exc
        c = done.body
        return pb.ChatCompletionResponse(
            id=c.id,
            model=c.model,
            created=c.created,
            content=c.choices[0].message.content,
            finish_reason=c.choices[0].finish_reason,
            usage=_usage(c.usage, done.served),
        )

    async def ChatCompletionStream(
        self, request: pb.ChatCompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ChatCompletionStreamResponse]:
        try:
            who = self._principal(context)
            req = self._chat_request(request, stream=True)
            routed = await self._svc.answer(req, who)
            a, finish = routed.body, "stop"
            async with aclosing(a.pieces) as pieces:
                async for p in pieces:
                    if p.text:
                        yield pb.ChatCompletionStreamResponse(
                            id=a.id, model=req.model, delta=p.text
                        )
                    finish = p.finish_reason or finish
                    if p.usage is not None:
                        end = pb.StreamEnd(
                            finish_reason=finish, usage=_usage(p.usage, routed.served)
                        )
                        yield pb.ChatCompletionStreamResponse(id=a.id, model=req.model, end=end)
        except APIError as exc:
            await self._fail(context, client_named(exc, _part_names(request.messages)))

    async def Completion(
        self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompletionResponse:
        try:
            who = self._principal(context)
            data: dict[str, Any] = {"model": request.model, **_sampling(request.sampling)}
            which = request.WhichOneof("prompt")
            data["prompt"] = (
                list(request.token_ids.ids) if which == "token_ids" else request.text or None
            )
            done = await self._svc.complete(_validate(CompletionRequest, data), who)
        except APIError as exc:
            await self._fail(context, exc)
            raise AssertionError("unreachable") from exc
        c = done.body
        return pb.CompletionResponse(
            id=c.id,
            model=c.model,
            created=c.created,
            text=c.choices[0].text,
            finish_reason=c.choices[0].finish_reason or "stop",
            usage=_usage(c.usage, done.served),
        )

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            self._principal(context)
        except APIError as exc:
            await self._fail(context, exc)
        models = self._svc.models().data
        return pb.ListModelsResponse(
            models=[
                pb.Model(id=m.id, owned_by=m.owned_by, max_model_len=m.max_model_len or 0)
                for m in models
            ]
        )

    # --------------------------------------------------------------- cache

    async def _admin(
        self,
        context: grpc.aio.ServicerContext,
        run: Callable[[Principal], Awaitable[BaseModel | dict[str, Any]]],
        out: P,
    ) -> P:
        """An admin cache call: its pydantic answer (the HTTP API's) copied into ``out``
        by field name (fields only HTTP shows are left out)."""
        try:
            who = self._principal(context)
            CacheService.require_admin(who)
            result = await run(who)
        except APIError as exc:
            await self._fail(context, exc)
            raise  # abort_with_status raised already; never reached
        data = result.model_dump(mode="json") if isinstance(result, BaseModel) else result
        target = out.stats if isinstance(out, pb.StatsResponse) else out
        json_format.ParseDict(data, target, ignore_unknown_fields=True)
        return out

    # Each cache RPC is the HTTP cache API's operation, answered in proto.
    Lookup = _cache_rpc("lookup", pb.LookupResponse)
    Warm = _cache_rpc("warm", pb.WarmResponse)
    Pin = _cache_rpc("pin", pb.PinResponse)
    Unpin = _cache_rpc("unpin", pb.UnpinResponse)
    Evict = _cache_rpc("evict", pb.EvictResponse)

    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        cache = self._cache_service
        return await self._admin(context, lambda who: cache.stats(), pb.StatsResponse())


class GrpcServer:
    """A ``grpc.aio`` server in the gateway's own event loop, with health and reflection."""

    def __init__(
        self,
        servicer: GatewayServicer,
        host: str,
        port: int,
        max_message_bytes: int,
        reuse_port: bool = False,
    ):
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            # one gateway alone must find its port free; workers share theirs
            ("grpc.so_reuseport", int(reuse_port)),
        ]
        self._server = grpc.aio.server(options=options)
        add_servicer(servicer, self._server, SERVICE_NAME)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.port = self._server.add_insecure_port(f"{host}:{port}")

    async def start(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        log.info("gRPC listening on port %d", self.port)

    async def _set(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def set_serving(self, serving: bool) -> None:
        """SERVING while the gateway can serve its local model (or its providers)."""
        r = health_pb2.HealthCheckResponse
        await self._set(r.SERVING if serving else r.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
