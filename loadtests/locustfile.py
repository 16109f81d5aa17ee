"""Locust users for vcache: streaming chat over HTTP or gRPC on a pre-built workload.

Run through ``loadtests/run.py`` (``make loadtest``), which builds the
workload, sets the environment below and writes the report:

- ``VCACHE_WORKLOAD``: the workload JSON (loadtests/workloads.py)
- ``VCACHE_RAW_CSV``: where raw per-request values go (locust rounds response
  times above 100 ms, so summaries are computed from this file)
- ``VCACHE_API_KEY``, ``VCACHE_MODEL``: optional (the key goes on every request)
- ``VCACHE_ROUTING`` (a policy) or ``VCACHE_ORACLE_REPLICAS`` (N: group g goes
  to replica g mod N): routing comparisons, which need an admin key in
  ``VCACHE_API_KEY`` (admin_key.py: the key of the gateways the load tests start)
- ``VCACHE_GRPC_TARGET``: ``host:port`` of the gateway's gRPC API (``GrpcChatUser``)

Pick the user class on locust's command line: ``ChatUser`` (HTTP, a
``FastHttpUser`` reading server-sent events) or ``GrpcChatUser``
(``ChatCompletionStream``; gevent-compatible through
``grpc.experimental.gevent``, timed by a client interceptor).  Each request
fires three request events: ``ttft`` (first non-empty content delta),
``itl`` (mean gap between content deltas) and ``total``.  A system prompt
containing ``{now}`` gets the current UTC time at send time (the volatile
line of the layout comparison).
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import Any

import gevent
import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import FastHttpUser, User, constant, events, task
from locust.exception import StopUser
from locust.stats import CSV_STATS_FLUSH_INTERVAL_SEC, CSV_STATS_INTERVAL_SEC

from engines.sse import SSEDecoder
from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.api import gateway_pb2_grpc as pb_grpc
from loadtests.fasthttp import lines
from loadtests.workloads import Session, Turn, Workload

grpc_gevent.init_gevent()  # before any channel exists: gRPC's I/O then yields to gevent


RAW_FIELDS = [
    "workload",
    "label",
    "ok",
    "ttft_ms",
    "itl_mean_ms",
    "total_ms",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "target",
    "replica",
    "predicted_cached_tokens",
    "t",
]


class Plan:
    """The workload's sessions, handed out once each, in order."""

    def __init__(self, workload: Workload, raw_path: Path) -> None:
        self.workload = workload
        self._next = 0
        self.t0 = time.monotonic()  # sessions with a start_s wait for it from here
        new = not raw_path.exists()
        self._file = raw_path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=RAW_FIELDS)
        if new:
            self._writer.writeheader()

    def take(self) -> Session | None:
        if self._next >= len(self.workload.sessions):
            return None
        self._next += 1
        return self.workload.sessions[self._next - 1]

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self.workload.sessions)

    def record(self, row: dict[str, Any]) -> None:
        self._writer.writerow({"workload": self.workload.name, "t": time.time(), **row})
        self._file.flush()


@events.init.add_listener  # type: ignore[untyped-decorator]
def _init(environment: Any, **_: Any) -> None:
    environment.vcache_plan = Plan(
        Workload.load(Path(os.environ["VCACHE_WORKLOAD"])), Path(os.environ["VCACHE_RAW_CSV"])
    )


@events.test_start.add_listener  # type: ignore[untyped-decorator]
def _stop_when_done(environment: Any, **_: Any) -> None:
    """End the run once every session was sent and every user has finished."""
    environment.vcache_plan.t0 = time.monotonic()

    def watch() -> None:
        while True:
            gevent.sleep(0.2)
            runner = environment.runner
            if environment.vcache_plan.exhausted and runner is not None and runner.user_count == 0:
                # locust writes its CSV files every CSV_STATS_INTERVAL_SEC and not at quit:
                # wait for one more write (and flush) so they hold the whole run
                gevent.sleep(max(CSV_STATS_INTERVAL_SEC, CSV_STATS_FLUSH_INTERVAL_SEC) + 0.5)
                runner.quit()
                return

    gevent.spawn(watch)


def _system(text: str) -> str:
    t = time.time()
    now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"
    return text.replace("{now}", now)


def _session(user: Any, chat: Any) -> None:
    """One session of the plan, turn by turn; ``chat(history, turn, plan)`` answers."""
    plan: Plan = user.environment.vcache_plan
    session = plan.take()
    if session is None:
        raise StopUser()
    wait = plan.t0 + session.start_s - time.monotonic()
    if wait > 0:  # a scheduled session (bursty workloads): not before its time
        gevent.sleep(wait)
    history: list[dict[str, str]] = []
    if session.system:
        history.append({"role": "system", "content": _system(session.system)})
    for i, turn in enumerate(session.turns):
        if i and session.think_time_s:
            gevent.sleep(session.think_time_s)
        history.append({"role": "user", "content": turn.user})
        answer = chat(history, turn, plan)
        if answer is None:
            return  # a failed turn ends the session; later turns would not extend it
        history.append({"role": "assistant", "content": answer})


def _fire(environment: Any, kind: str, name: str, seconds: float, exc: Exception | None) -> None:
    environment.events.request.fire(
        request_type=kind,
        name=name,
        response_time=seconds * 1000,
        response_length=0,
        exception=exc,
        context={},
    )


class ChatUser(FastHttpUser):
    wait_time = constant(0)

    def _fire(self, name: str, seconds: float) -> None:
        _fire(self.environment, "SSE", name, seconds, None)

    @task
    def run_session(self) -> None:
        _session(self, self._chat)

    def _chat(self, messages: list[dict[str, str]], turn: Turn, plan: Plan) -> str | None:
        body = {
            "model": os.environ.get("VCACHE_MODEL", "vcache-demo"),
            "messages": messages,
            "max_tokens": turn.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {}
        if os.environ.get("VCACHE_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['VCACHE_API_KEY']}"
        if os.environ.get("VCACHE_ROUTING"):  # a policy comparison (admin key)
            headers["x-vcache-routing"] = os.environ["VCACHE_ROUTING"]
        oracle = int(os.environ.get("VCACHE_ORACLE_REPLICAS", "0"))
        if oracle and turn.label.startswith("group-"):  # the oracle: one replica per group
            headers["x-vcache-replica"] = f"replica-{int(turn.label[6:]) % oracle}"
        t0 = time.perf_counter()
        first: float | None = None
        last = 0.0
        gaps: list[float] = []
        text: list[str] = []
        usage: dict[str, Any] = {}
        with self.client.request(
            "POST",
            "/v1/chat/completions",
            json=body,
            headers=headers,
            stream=True,
            catch_response=True,
            name="chat",
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                plan.record({"label": turn.label, "ok": 0})
                return None
            decoder = SSEDecoder()
            for chunk in lines(resp):
                for ev in decoder.feed(chunk):
                    if ev.data == "[DONE]":
                        continue
                    data = json.loads(ev.data)
                    if "error" in data:
                        resp.failure(data["error"].get("message", "stream error"))
                        plan.record({"label": turn.label, "ok": 0})
                        return None
                    usage = data.get("usage") or usage
                    for choice in data.get("choices", []):
                        content = choice.get("delta", {}).get("content")
                        if content:
                            now = time.perf_counter()
                            if first is None:
                                first = now
                            else:
                                gaps.append(now - last)
                            last = now
                            text.append(content)
            resp.success()
            replica = resp.headers.get("x-vcache-replica", "")
            target = resp.headers.get("x-vcache-target", "local")
            predicted = resp.headers.get("x-vcache-predicted-cached-tokens", "")
        total = time.perf_counter() - t0
        ttft = (first - t0) if first is not None else total
        itl = sum(gaps) / len(gaps) if gaps else 0.0
        self._fire("ttft", ttft)
        if gaps:
            self._fire("itl", itl)
        self._fire("total", total)
        plan.record(
            {
                "label": turn.label,
                "ok": 1,
                "ttft_ms": round(ttft * 1000, 3),
                "itl_mean_ms": round(itl * 1000, 3),
                "total_ms": round(total * 1000, 3),
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "completion_tokens": usage.get("completion_tokens", 0),
                "target": target,
                "replica": replica,
                "predicted_cached_tokens": predicted,
            }
        )
        return "".join(text)


class TimedStream:
    """A server-streaming call's responses, timed as they arrive; fires the locust events
    (``ttft``, ``itl``, ``total``, request type ``gRPC``) when the stream ends."""

    def __init__(self, call: Any, t0: float, environment: Any) -> None:
        self._call = call
        self._env = environment
        self.t0 = t0
        self.first: float | None = None
        self.gaps: list[float] = []
        self.total = 0.0
        self._last = 0.0

    def __iter__(self) -> Any:
        try:
            for msg in self._call:
                if msg.WhichOneof("event") == "delta" and msg.delta:
                    now = time.perf_counter()
                    if self.first is None:
                        self.first = now - self.t0
                    else:
                        self.gaps.append(now - self._last)
                    self._last = now
                yield msg
        except grpc.RpcError as exc:
            _fire(self._env, "gRPC", "total", time.perf_counter() - self.t0, exc)
            raise
        self.total = time.perf_counter() - self.t0
        _fire(self._env, "gRPC", "ttft", self.first or self.total, None)
        if self.gaps:
            _fire(self._env, "gRPC", "itl", sum(self.gaps) / len(self.gaps), None)
        _fire(self._env, "gRPC", "total", self.total, None)


class EventInterceptor(grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Times every server-streaming call made through the channel."""

    def __init__(self, environment: Any) -> None:
        self._env = environment

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        t0 = time.perf_counter()
        return TimedStream(continuation(details, request), t0, self._env)


class GrpcChatUser(User):
    """``ChatCompletionStream`` over gRPC (no grpc.aio: gevent drives the sync API)."""

    wait_time = constant(0)

    def on_start(self) -> None:
        channel = grpc.insecure_channel(os.environ["VCACHE_GRPC_TARGET"])
        self._channel = grpc.intercept_channel(channel, EventInterceptor(self.environment))
        self._stub = pb_grpc.GatewayStub(self._channel)  # type: ignore[no-untyped-call]
        key = os.environ.get("VCACHE_API_KEY")
        self._metadata = [("authorization", f"Bearer {key}")] if key else []

    def on_stop(self) -> None:
        self._channel.close()

    @task
    def run_session(self) -> None:
        _session(self, self._chat)

    def _chat(self, messages: list[dict[str, str]], turn: Turn, plan: Plan) -> str | None:
        req = pb.ChatCompletionRequest(
            model=os.environ.get("VCACHE_MODEL", "vcache-demo"),
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
            sampling=pb.SamplingParams(max_tokens=turn.max_tokens, ignore_eos=True),
        )
        responses = self._stub.ChatCompletionStream(req, metadata=self._metadata)
        text: list[str] = []
        usage: Any = None
        try:
            for msg in responses:
                if msg.WhichOneof("event") == "delta":
                    text.append(msg.delta)
                elif msg.WhichOneof("event") == "end":
                    usage = msg.end.usage
        except grpc.RpcError:
            plan.record({"label": turn.label, "ok": 0})
            return None
        stream: TimedStream = responses
        itl = sum(stream.gaps) / len(stream.gaps) if stream.gaps else 0.0
        plan.record(
            {
                "label": turn.label,
                "ok": 1,
                "ttft_ms": round((stream.first or stream.total) * 1000, 3),
                "itl_mean_ms": round(itl * 1000, 3),
                "total_ms": round(stream.total * 1000, 3),
                "prompt_tokens": usage.prompt_tokens if usage else 0,
                "cached_tokens": usage.cached_tokens if usage else 0,
                "completion_tokens": usage.completion_tokens if usage else 0,
                "target": usage.target if usage else "",
                "replica": usage.replica if usage else "",
                "predicted_cached_tokens": (
                    usage.predicted_cached_tokens
                    if usage and usage.HasField("predicted_cached_tokens")
                    else ""
                ),
            }
        )
        return "".join(text)
