"""Locust users for vcache: HTTP streaming chat over a pre-built workload.

Run through ``loadtests/run.py`` (``make loadtest``), which builds the
workload, sets the environment below and writes the report:

- ``VCACHE_WORKLOAD``: the workload JSON (loadtests/workloads.py)
- ``VCACHE_RAW_CSV``: where raw per-request values go (locust rounds response
  times above 100 ms, so summaries are computed from this file)
- ``VCACHE_API_KEY``, ``VCACHE_MODEL``: optional
- ``VCACHE_ROUTING`` (a policy) or ``VCACHE_ORACLE_REPLICAS`` (N: group g goes
  to replica g mod N): routing comparisons, with an admin key

Each request fires three request events: ``ttft`` (first non-empty
``delta.content``), ``itl`` (mean gap between content deltas) and ``total``.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import gevent
from locust import FastHttpUser, constant, events, task
from locust.exception import StopUser

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from workloads import Session, Turn, Workload  # noqa: E402

from engines.sse import SSEDecoder  # noqa: E402

RAW_FIELDS = [
    "workload", "label", "ok", "ttft_ms", "itl_mean_ms", "total_ms", "prompt_tokens",
    "cached_tokens", "completion_tokens", "target", "replica", "predicted_cached_tokens", "t",
]  # fmt: skip


class Plan:
    """The workload's sessions, handed out once each, in order."""

    def __init__(self, workload: Workload, raw_path: Path) -> None:
        self.workload = workload
        self._next = 0
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

    def watch() -> None:
        while True:
            gevent.sleep(0.2)
            runner = environment.runner
            if environment.vcache_plan.exhausted and runner is not None and runner.user_count == 0:
                runner.quit()
                return

    gevent.spawn(watch)


def _lines(resp: Any) -> Any:
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


class ChatUser(FastHttpUser):
    wait_time = constant(0)

    def _fire(self, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type="SSE",
            name=name,
            response_time=seconds * 1000,
            response_length=0,
            exception=None,
            context={},
        )

    @task
    def run_session(self) -> None:
        plan: Plan = self.environment.vcache_plan
        session = plan.take()
        if session is None:
            raise StopUser()
        history: list[dict[str, str]] = []
        if session.system:
            history.append({"role": "system", "content": session.system})
        for i, turn in enumerate(session.turns):
            if i and session.think_time_s:
                gevent.sleep(session.think_time_s)
            history.append({"role": "user", "content": turn.user})
            answer = self._chat(history, turn, plan)
            if answer is None:
                return  # a failed turn ends the session; later turns would not extend it
            history.append({"role": "assistant", "content": answer})

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
            for chunk in _lines(resp):
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
                "target": "local",
                "replica": replica,
                "predicted_cached_tokens": predicted,
            }
        )
        return "".join(text)
