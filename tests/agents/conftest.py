"""The agent tier: the real Codex CLI, Claude Code and opencode against ``vcache serve``.

One gateway for the tier (module-scoped: stopped when the tier's tests end, not kept
through the rest of a full run), a subprocess started as a user starts it (the
integration tier's ``own_gateway``): the demo model with a 131,072-token context,
an operator's output ceiling (``engine.max_output_tokens``: the demo model's
random weights would otherwise write until the context is full), its session
log verified, one API key, and aliases for the names the agents ask for: their
defaults (``gpt-5.5``, ``claude-opus-5-5``; opencode's configured ``qwen3-coder``) on
the local model, and the same names with ``-emulated`` on the provider emulator
(``python -m loadtests.emulator``, the providers tier's ``emulator_server``) as OpenAI
and Anthropic.

The CLIs are installed from the npm registry at their pinned versions
(tests/agents/clients.py); without ``npm`` the tier is skipped, and fails
under ``CI=true``.  Each run's summary is written under the session's temp dir
and the table printed at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gateway.core.config import hash_api_key
from tests.agents import clients
from tests.agents.audit import SessionLogReader, Summary, table
from tests.integration.conftest import own_gateway
from tests.providers.conftest import PROVIDER_KEY, Emulator
from tests.providers.conftest import emulator_server as emulator_server  # the fixture

KEY = "sk-test-agents"
MAX_MODEL_LEN = 131072
MAX_OUTPUT_TOKENS = 32
KV_CACHE_BYTES = 512 << 20  # 256k tokens of the demo model: every run's prompts stay cached
# the provider model behind each agent's -emulated alias
EMULATED = {
    clients.CODEX.name: "openai/gpt-5",
    clients.CLAUDE_CODE.name: "anthropic/claude-sonnet-4-5",
    clients.OPENCODE.name: "openai/gpt-5",  # its Chat Completions, as OpenAI takes them
}

RUNS = pytest.StashKey[list[Summary]]()
RUNS_DIR = pytest.StashKey[Path]()


@pytest.fixture(scope="session")
def agent_binaries() -> dict[str, Path]:
    """Each agent CLI, installed (or found in the cache) at its pinned version."""
    try:
        return {a.name: clients.install(a) for a in clients.AGENTS}
    except clients.NpmMissing as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{exc} (CI=true: the agent tier must run)")
        pytest.skip(f"agent tier skipped: {exc}; install Node.js with npm to run it")


@dataclass(frozen=True)
class AgentsGateway:
    url: str
    key: str
    sessions: Path  # its session log (SQLite)
    model: Path  # its model (the demo model): the tokenizer rebuilds use
    log: Path  # its output


@pytest.fixture(scope="module")
def agents_gateway(
    data_dir: Path,
    demo_model: Path,
    emulator_server: Emulator,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[AgentsGateway]:
    tmp = tmp_path_factory.mktemp("agents-gateway")
    config = {
        "providers": {
            p: {"base_url": emulator_server.base_url(p), "api_key": PROVIDER_KEY}
            for p in ("anthropic", "openai")
        },
        "aliases": clients.aliases(EMULATED),
    }
    (tmp / "vcache.yaml").write_text(yaml.safe_dump(config))
    keys = [{"sha256": hash_api_key(KEY), "tenant": "agents", "name": "agents"}]
    settings = {
        "VCACHE_API_KEYS": json.dumps(keys),
        "VCACHE_ENGINE__MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
        # the demo model's random words run to the ceiling; both agents take an answer
        # that says it was cut for a failed turn: end it as the model's own end
        "VCACHE_ENGINE__MAX_OUTPUT_TOKENS_FINISH": "stop",
    }
    args = [
        "--config",
        str(tmp / "vcache.yaml"),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-bytes",
        str(KV_CACHE_BYTES),
    ]
    with own_gateway(tmp, data_dir, args, settings) as url:
        yield AgentsGateway(url, KEY, tmp / "sessions.db", demo_model, tmp / "gateway.log")


@pytest.fixture(scope="module")
def agents_log(agents_gateway: AgentsGateway) -> Iterator[SessionLogReader]:
    """The gateway's session log, read while it runs (SQLite in WAL mode)."""
    reader = SessionLogReader(agents_gateway.sessions, agents_gateway.model)
    try:
        yield reader
    finally:
        reader.close()


@pytest.fixture(scope="session")
def agent_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, list[Summary]]]:
    """Where each run goes, and the runs' summaries (all of them in summary.json at the
    end, and the table in the terminal summary)."""
    root = tmp_path_factory.mktemp("agent-runs")
    runs: list[Summary] = []
    request.config.stash[RUNS] = runs
    request.config.stash[RUNS_DIR] = root
    yield root, runs
    (root / "summary.json").write_text(json.dumps([s.to_json() for s in runs], indent=2))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    runs = terminalreporter.config.stash.get(RUNS, None)
    if not runs:
        return
    terminalreporter.write_sep("-", "agent clients")
    terminalreporter.write_line(table(runs))
    terminalreporter.write_line(f"summaries: {terminalreporter.config.stash[RUNS_DIR]}")
