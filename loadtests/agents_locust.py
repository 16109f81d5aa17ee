"""Locust users for the agent-sessions benchmark (loadtests/agent_sessions.py runs it).

``AgentUser``: one agent session after another from ``VCACHE_WORKLOAD``.  A
turn sends the conversation so far with the agent type's tools; every turn
but the last forces a tool call (the demo model has random weights: a named
``tool_choice`` makes it call), the tool "runs" for the turn's gap, and its
result goes back as a ``tool`` message; the last turn answers in text.  The
session is named by ``x-vcache-session`` (ignored by other servers).
``BackgroundUser``: another tenant's short unrelated requests, back to back
(KV pressure).  Rows go to ``VCACHE_RAW_CSV``: per turn its TTFT, prompt
and cached tokens, and the *reusable* tokens: the full blocks of the
session's previous prompt, which the turn re-sends.
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import Any

import gevent
from locust import FastHttpUser, constant, constant_throughput, events, task
from locust.exception import StopUser

from engines.sse import SSEDecoder
from loadtests.fasthttp import lines

BLOCK = 128
FIELDS = [
    "kind",
    "session",
    "agent",
    "turn",
    "ok",
    "ttft_ms",
    "prompt_tokens",
    "cached_tokens",
    "reusable_tokens",
    "replica",
    "finish",
    "t",
]


class Plan:
    def __init__(self) -> None:
        raw = json.loads(Path(os.environ["VCACHE_WORKLOAD"]).read_text())
        self.sessions: list[dict[str, Any]] = raw["sessions"]
        self.background: list[str] = raw["background"]
        self.tools: dict[str, list[Any]] = raw["tools"]
        self.next = 0
        self.active = 0  # agent sessions running
        self.t0 = time.monotonic()
        self._file = Path(os.environ["VCACHE_RAW_CSV"]).open("w", newline="")  # noqa: SIM115 (the run's)
        self._csv = csv.DictWriter(self._file, FIELDS)
        self._csv.writeheader()

    def take(self) -> dict[str, Any] | None:
        if self.next >= len(self.sessions):
            return None
        self.next += 1
        return self.sessions[self.next - 1]

    def record(self, row: dict[str, Any]) -> None:
        self._csv.writerow({**row, "t": round(time.monotonic() - self.t0, 3)})
        self._file.flush()


@events.init.add_listener  # type: ignore[untyped-decorator]
def _init(environment: Any, **_: Any) -> None:
    environment.agents_plan = Plan()


@events.test_start.add_listener  # type: ignore[untyped-decorator]
def _stop_when_done(environment: Any, **_: Any) -> None:
    """End the run once every agent session was sent and has finished (the background
    tenant runs until then)."""
    plan: Plan = environment.agents_plan
    plan.t0 = time.monotonic()

    def watch() -> None:
        while True:
            gevent.sleep(0.2)
            if plan.next >= len(plan.sessions) and plan.active == 0:
                environment.runner.quit()
                return

    gevent.spawn(watch)


def _headers(key: str) -> dict[str, str]:
    value = os.environ.get(key)
    return {"Authorization": f"Bearer {value}"} if value else {}


def _stream(user: Any, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
    """POST a streamed chat request; the first delta's time, the text, the tool calls,
    the usage and the finish reason (None: it failed, before its answer began or while
    it was read, e.g. the client's 60 s network timeout: such a turn is a row with
    ``ok`` 0, not lost)."""
    t0 = time.perf_counter()
    first: float | None = None
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] = {}
    finish = ""
    with user.client.request(
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
            return None
        decoder = SSEDecoder()
        try:
            for line in lines(resp):
                for ev in decoder.feed(line):
                    if ev.data == "[DONE]":
                        continue
                    data = json.loads(ev.data)
                    usage = data.get("usage") or usage
                    for ch in data.get("choices", []):
                        delta = ch.get("delta", {})
                        if (delta.get("content") or delta.get("tool_calls")) and first is None:
                            first = time.perf_counter()
                        for tc in delta.get("tool_calls") or []:
                            c = calls.setdefault(tc["index"], {"id": "", "name": "", "args": ""})
                            c["id"] = tc.get("id") or c["id"]
                            fn = tc.get("function") or {}
                            c["name"] = fn.get("name") or c["name"]
                            c["args"] += fn.get("arguments") or ""
                        finish = ch.get("finish_reason") or finish
        except Exception as exc:  # a read that timed out or broke: the turn failed
            resp.failure(f"{type(exc).__name__}: {exc}")
            return None
        resp.success()
        replica = resp.headers.get("x-vcache-replica", "")
    end = time.perf_counter()
    ttft = (first or end) - t0
    return {
        "ttft": ttft,
        "calls": [calls[i] for i in sorted(calls)],
        "usage": usage,
        "finish": finish,
        "replica": replica,
    }


class AgentUser(FastHttpUser):
    wait_time = constant(0)

    @task
    def session(self) -> None:
        plan: Plan = self.environment.agents_plan
        s = plan.take()
        if s is None:
            raise StopUser()
        plan.active += 1
        try:
            self._run(plan, s)
        finally:
            plan.active -= 1

    def _run(self, plan: Plan, s: dict[str, Any]) -> None:
        model = os.environ.get("VCACHE_MODEL", "vcache-demo")
        tools = plan.tools[s["agent"]]
        history: list[Any] = [
            {"role": "system", "content": s["system"]},
            {"role": "user", "content": s["ask"]},
        ]
        headers = {**_headers("VCACHE_API_KEY"), "x-vcache-session": s["id"]}
        if os.environ.get("VCACHE_ROUTING"):
            headers["x-vcache-routing"] = os.environ["VCACHE_ROUTING"]
        prev_prompt = 0
        for k, turn in enumerate(s["turns"]):
            final = k == len(s["turns"]) - 1
            forced = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
            body = {
                "model": model,
                "messages": history,
                "tools": tools,
                "tool_choice": "none" if final else forced,
                "max_tokens": 40,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            got = _stream(self, body, headers)
            reusable = (prev_prompt // BLOCK) * BLOCK if k else 0
            row = {
                "kind": "agent",
                "session": s["id"],
                "agent": s["agent"],
                "turn": k,
                "reusable_tokens": reusable,
            }
            if got is None or (not final and not got["calls"]):
                plan.record({**row, "ok": 0})
                return  # a failed turn ends the session: later turns would not extend it
            u = got["usage"]
            prev_prompt = int(u.get("prompt_tokens", 0))
            cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            plan.record(
                {
                    **row,
                    "ok": 1,
                    "ttft_ms": round(got["ttft"] * 1000, 3),
                    "prompt_tokens": prev_prompt,
                    "cached_tokens": cached,
                    "replica": got["replica"],
                    "finish": got["finish"],
                }
            )
            if final:
                return
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["args"]},
                }
                for c in got["calls"]
            ]
            history.append({"role": "assistant", "content": None, "tool_calls": calls})
            for c in calls:
                history.append({"role": "tool", "tool_call_id": c["id"], "content": turn["result"]})
            gevent.sleep(turn["gap_s"])  # the tool runs


class BackgroundUser(FastHttpUser):
    """Another tenant's short, unrelated requests (nothing of them is reused)."""

    fixed_count = int(os.environ.get("VCACHE_BACKGROUND_USERS", "1"))
    # a fixed rate per user (VCACHE_BACKGROUND_RPS), or a fixed pause after each request
    wait_time = (
        constant_throughput(float(os.environ["VCACHE_BACKGROUND_RPS"]))
        if os.environ.get("VCACHE_BACKGROUND_RPS")
        else constant(float(os.environ.get("VCACHE_BACKGROUND_WAIT_S", "0.2")))
    )

    @task
    def ask(self) -> None:
        plan: Plan = self.environment.agents_plan
        i = int(time.monotonic() * 1000) % len(plan.background)
        text = f"[{time.monotonic_ns()}] " + plan.background[i]
        body = {
            "model": os.environ.get("VCACHE_MODEL", "vcache-demo"),
            "max_tokens": 8,
            "messages": [{"role": "user", "content": text}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = _headers("VCACHE_BACKGROUND_KEY")
        if os.environ.get("VCACHE_BACKGROUND_PRIORITY"):  # else its key's default
            headers["x-vcache-priority"] = os.environ["VCACHE_BACKGROUND_PRIORITY"]
        got = _stream(self, body, headers)
        plan.record(
            {
                "kind": "background",
                "ok": 0 if got is None else 1,
                "ttft_ms": round(got["ttft"] * 1000, 3) if got else "",
            }
        )
