"""Contract fuzzing: schemathesis against a running gateway, keys on.

Starts the provider emulator and ``vcache serve`` (the demo model on the
local vLLM engine, the four hosted providers on the emulator, API keys
required), then runs schemathesis on the gateway's own OpenAPI document:
examples, fuzzing and stateful phases, bounded by ``--max-examples`` per
operation and ``--max-time``.  Every response is checked; the targets are
zero server errors (5xx) and zero responses that break the documented schema
(status, content type, body).  Prints a table, writes the JSON report,
exits 1 on a missed target.

    .venv/bin/python -m scripts.fuzz_api --max-examples 30
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from loadtests.procs import free_port, get_ok, serving

REPO = Path(__file__).resolve().parents[1]

KEY = "sk-fuzz-admin"
GATING = {
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
}


def _ready(base: str) -> bool:
    """Ready; a gateway whose engine failed to start stops the run at once."""
    try:
        r = httpx.get(f"{base}/readyz", timeout=2)
    except httpx.TransportError:
        return False
    if r.status_code != 200 and r.json().get("status") == "failed":
        raise SystemExit(f"the gateway failed to start: {r.json().get('error')}")
    return r.status_code == 200


def _env(emulator: str, tmp: Path) -> dict[str, str]:
    from gateway.core.config import hash_api_key

    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    keys = [{"sha256": hash_api_key(KEY), "tenant": "fuzz", "admin": True, "scope": "global"}]
    env["VCACHE_API_KEYS"] = json.dumps(keys)
    bases = {"anthropic": "/v1", "openai": "/v1", "gemini": "/v1beta", "deepseek": "/deepseek"}
    providers = {
        p: {"base_url": f"{emulator}{b}", "api_key": "sk-emulator", "max_retries": 0}
        for p, b in bases.items()
    }
    env["VCACHE_PROVIDERS"] = json.dumps(providers)
    env["VCACHE_ALIASES"] = json.dumps({"smart": ["local", "anthropic/claude-sonnet-4-5"]})
    env["VCACHE_SESSION_LOG__PATH"] = str(tmp / "sessions.db")
    return env


def _summary(ndjson: Path) -> dict[str, object]:
    """Counts from schemathesis's event stream: responses by status, failed checks."""
    statuses: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for line in ndjson.read_text().splitlines():
        _collect(json.loads(line), statuses, failures, examples)
    return {"statuses": dict(statuses), "failures": dict(failures), "examples": examples}


def _collect(
    node: object, statuses: Counter[str], failures: Counter[str], examples: dict[str, str]
) -> None:
    """Walk an event: every ``response`` with a status, every ``check`` with a result."""
    if isinstance(node, dict):
        response = node.get("response")
        if isinstance(response, dict) and isinstance(response.get("status_code"), int):
            statuses[str(response["status_code"])] += 1
        name, status = node.get("name"), node.get("status")
        if isinstance(name, str) and status in ("failure", "FAILURE", "failed"):
            failures[name] += 1
            failure = node.get("failure_info") or node.get("failure") or {}
            examples.setdefault(name, json.dumps(failure, default=str)[:600])
        for value in node.values():
            _collect(value, statuses, failures, examples)
    elif isinstance(node, list):
        for value in node:
            _collect(value, statuses, failures, examples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--max-examples", type=int, default=30)
    ap.add_argument("--max-time", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data-dir", type=Path, default=REPO / ".vcache-test-data")
    ap.add_argument("--out", type=Path, default=REPO / "reports" / "fuzz")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vcache-fuzz-"))
    eport, port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        emulator = [sys.executable, "-m", "loadtests.emulator", "--port", str(eport)]
        ready = functools.partial(get_ok, f"http://127.0.0.1:{eport}/admin/requests")
        stack.enter_context(serving(emulator, ready, tmp / "emulator.log", cwd=REPO))
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--port",
            str(port),
            "--grpc-port",
            "0",
            "--data-dir",
            str(a.data_dir),
            "--max-model-len",
            "256",
            "--enforce-eager",
            "--kv-cache-bytes",
            str(32 << 20),
            "--log-level",
            "warning",
        ]
        env = _env(f"http://127.0.0.1:{eport}", tmp)
        gw = stack.enter_context(serving(cmd, lambda: _ready(base), tmp / "gateway.log", env, REPO))
        a.out.mkdir(parents=True, exist_ok=True)
        ndjson = a.out / "events.ndjson"
        st = [
            str(Path(sys.executable).with_name("schemathesis")),
            "run",
            f"{base}/openapi.json",
            "--checks",
            "all",
            "--phases",
            "examples,fuzzing,stateful",
            "--max-examples",
            str(a.max_examples),
            "--max-time",
            str(a.max_time),
            "--seed",
            str(a.seed),
            "--workers",
            "2",
            "--request-timeout",
            "60",
            "-H",
            f"Authorization: Bearer {KEY}",
            "--no-color",
            "--report",
            "ndjson",
            "--report-ndjson-path",
            str(ndjson),
            "--generation-database",
            "none",
            "--continue-on-failure",
        ]
        t0 = time.monotonic()
        run = subprocess.run(st, cwd=tmp, capture_output=True, text=True)  # its cache: in tmp
        elapsed = time.monotonic() - t0
        (a.out / "schemathesis.txt").write_text(run.stdout + run.stderr)
        summary = _summary(ndjson)
        alive = gw.poll() is None
    statuses: dict[str, int] = summary["statuses"]  # type: ignore[assignment]
    failures: dict[str, int] = summary["failures"]  # type: ignore[assignment]
    server_errors = sum(n for s, n in statuses.items() if s.startswith("5"))
    gating = {k: n for k, n in failures.items() if k in GATING}
    print(
        f"schemathesis {elapsed:.0f} s, {sum(statuses.values())} responses, gateway alive: {alive}"
    )
    print("status    count")
    for s, n in sorted(statuses.items()):
        print(f"{s:<9} {n:>5}")
    print("check                              failures  gating")
    for k, n in sorted(failures.items()):
        print(f"{k:<34} {n:>8}  {'yes' if k in GATING else 'no'}")
    for k, ex in summary["examples"].items():  # type: ignore[attr-defined]
        print(f"  {k}: {ex}")
    result = {"seconds": round(elapsed), "alive": alive, **summary}
    (a.out / "summary.json").write_text(json.dumps(result, indent=1))
    ok = alive and server_errors == 0 and not gating
    print(f"target: 0 5xx and 0 schema violations: {'ok' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
