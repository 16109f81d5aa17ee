"""Run an agent CLI's two-step task against a gateway and summarize it: the one place
the tier and ``scripts/agent_clients.sh`` compose the CLIs, the tap and the audit.

``python -m tests.agents.harness [BASE_URL]`` runs every agent and target against an
already running gateway and prints the table (see docs/agents_tier.md).  A run
of the gateway that serves other traffic meanwhile still summarizes right (the
tap counts the agent's own requests), except the prediction counter, which is
the gateway's whole.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.agents import clients
from tests.agents.audit import BLOCK_SIZE, SessionLogReader, Summary, reuse, table
from tests.agents.tap import Exchange, Tap

# the gateway's routes that generate (what the agents call)
GENERATION = ("/v1/responses", "/v1/messages", "/v1/chat/completions")


def counters(base_url: str) -> dict[str, float]:
    """The gateway's request and prediction counters ("name{labels}" → value)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in ("vcache_requests", "vcache_cached_token_predictions"):
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{fam.name}{{{labels}}}"] = s.value
    return out


def _delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _statuses(delta: Mapping[str, float]) -> dict[str, int]:
    """The gateway's count of answers on the generation routes: "route status" → n."""
    out = {}
    for k, v in delta.items():
        if k.startswith("vcache_requests{"):
            labels = dict(p.split("=", 1) for p in k[len("vcache_requests{") : -1].split(","))
            if labels["route"] in GENERATION:
                out[f"{labels['route']} {labels['status']}"] = int(v)
    return out


def _system_messages(exchanges: Sequence[Exchange]) -> int:
    """Requests with a ``role: system`` message among ``messages`` (Claude Code's
    mid-conversation system messages)."""
    n = 0
    for x in exchanges:
        body = x.body()
        msgs = body.get("messages") if isinstance(body, dict) else None
        if isinstance(msgs, list) and any(
            isinstance(m, dict) and m.get("role") == "system" for m in msgs
        ):
            n += 1
    return n


def run_leg(
    agent: clients.Agent,
    binary: Path,
    target: clients.Target,
    base_url: str,
    key: str,
    log: SessionLogReader | None,
    root: Path,
    block_size: int = BLOCK_SIZE,
    timeout_s: float = clients.STEP_TIMEOUT_S,
) -> Summary:
    """The agent's two steps through a tap in front of ``base_url``, summarized.  The
    follow-up is not run when the task's requests were refused (the leg stops there)."""
    before_ids = log.request_ids() if log is not None else set()
    before = counters(base_url)
    with Tap(base_url) as tap:
        steps = clients.two_steps(
            agent,
            binary,
            target,
            base_url=tap.url,
            key=key,
            root=root,
            timeout_s=timeout_s,
            go_on=lambda: all(x.ok for x in tap.exchanges),
        )
    exchanges = tap.exchanges
    delta = _delta(before, counters(base_url))
    logged = log.read(before_ids) if log is not None else []
    notes = []
    if log is None:
        notes.append("no session log given: rebuilds and cache reuse not checked")
    predictions = None
    if target == "local":
        local = sum(1 for r in logged if r.target == "local")
        matched = delta.get("vcache_cached_token_predictions{outcome=matched}", 0)
        predictions = (int(matched), local)
    summary = Summary(
        agent=agent.name,
        version=agent.version,
        target=target,
        model=agent.model(target),
        exit_codes=[s.returncode for s in steps],
        requests=len(exchanges),
        ok=sum(1 for x in exchanges if x.ok),
        gateway_statuses=_statuses(delta),
        failures=[x.record() for x in exchanges if not x.ok],
        logged=len(logged),
        rebuilt=sum(1 for r in logged if r.rebuilt),
        reuse=reuse(logged, block_size),
        predictions=predictions,
        system_messages=_system_messages(exchanges),
        notes=notes,
    )
    for i, s in enumerate(steps, 1):
        if s.returncode != 0:
            summary.notes.append(f"step {i}: {s.describe()}")
    (root / "summary.json").write_text(json.dumps(summary.to_json(), indent=2))
    (root / "exchanges.json").write_text(json.dumps([x.record() for x in exchanges], indent=2))
    scenario = f"{agent.name}-{target}"
    lines = (json.dumps(x.capture(scenario)) + "\n" for x in exchanges)
    (root / "captures.jsonl").write_text("".join(lines))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Run Codex, Claude Code and opencode's two-step tasks against a running vcache "
        "gateway; print requests, 2xx, cache reuse, predictions and rebuilds per agent."
    )
    p.add_argument("base_url", nargs="?", default="http://127.0.0.1:8000")
    p.add_argument(
        "--key",
        default=os.environ.get("VCACHE_API_KEY", "sk-none"),
        help="the gateway API key (VCACHE_API_KEY)",
    )
    p.add_argument(
        "--targets",
        default=os.environ.get("VCACHE_AGENTS_TARGETS", "local"),
        help="local and/or emulated, comma separated (emulated needs the gateway's "
        "*-emulated aliases)",
    )
    p.add_argument(
        "--agents", default=os.environ.get("VCACHE_AGENTS", "codex,claude-code,opencode")
    )
    p.add_argument(
        "--session-log",
        type=Path,
        default=os.environ.get("VCACHE_AGENTS_SESSION_LOG"),
        help="the gateway's session log (SQLite file; default <data-dir>/sessions.db)",
    )
    p.add_argument(
        "--session-log-url",
        default=os.environ.get("VCACHE_AGENTS_SESSION_LOG_URL"),
        help="or its PostgreSQL URL",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("VCACHE_DATA_DIR"),
        help="the gateway's data dir (its demo model and default session log)",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=os.environ.get("VCACHE_AGENTS_MODEL"),
        help="the gateway's model directory (default: the demo model)",
    )
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--timeout", type=float, default=clients.STEP_TIMEOUT_S)
    p.add_argument("--out", type=Path, default=None, help="where the runs and summary go")
    a = p.parse_args(argv)
    base = a.base_url.rstrip("/")
    data_dir = a.data_dir or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "vcache"
    )
    db = a.session_log or data_dir / "sessions.db"
    model = a.model
    if model is None:
        from engines.vllm.demo_model import ensure_demo_model

        model = ensure_demo_model(data_dir)
    log = None
    if a.session_log_url or db.exists():
        log = SessionLogReader(db, model, url=a.session_log_url)
    else:
        print(f"no session log at {db}: rebuilds and cache reuse are not checked")
    out = a.out or Path(tempfile.mkdtemp(prefix="vcache-agents-"))
    out.mkdir(parents=True, exist_ok=True)
    chosen = [x for x in clients.AGENTS if x.name in a.agents.split(",")]
    targets = [t for t in clients.TARGETS if t in a.targets.split(",")]
    summaries = []
    try:
        for agent in chosen:
            binary = clients.install(agent)
            for target in targets:
                print(f"{agent.name} {agent.version} on {target} ...", flush=True)
                s = run_leg(
                    agent,
                    binary,
                    target,
                    base,
                    a.key,
                    log,
                    out / f"{agent.name}-{target}",
                    a.block_size,
                    a.timeout,
                )
                summaries.append(s)
                for problem in s.problems():
                    print(f"  {problem}")
                if s.notes:
                    print(f"  details: {out / f'{agent.name}-{target}' / 'summary.json'}")
    finally:
        if log is not None:
            log.close()
    (out / "summary.json").write_text(json.dumps([s.to_json() for s in summaries], indent=2))
    print(table(summaries))
    print(f"runs and summary: {out}")
    return 0 if summaries and not any(s.problems() for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
