"""Codex, Claude Code and opencode, unchanged, do a two-step task through vcache
(issue 45).

Per agent and per target (the local model; the provider emulator through an
alias): the task, then the same conversation resumed (``codex exec resume
--last`` / ``claude -p --continue`` / ``opencode run --continue``).  Passes when
the agent exits 0 on both steps, every request it made was answered 2xx (the tap's
count, and the gateway's own by route and status), from the second request on each
read at least 90% of the prefix it shares with any earlier request of the run from
cache, every request rebuilds byte for byte from the session log, and on the local
model the gateway's prediction equals vLLM's cached tokens on every request
(tests/agents/audit.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agents import clients
from tests.agents.audit import SessionLogReader, Summary
from tests.agents.conftest import AgentsGateway
from tests.agents.harness import run_leg

# a real engine behind the gateway; the CLIs come from the npm registry
pytestmark = [pytest.mark.integration, pytest.mark.network]


@pytest.mark.parametrize("target", clients.TARGETS)
@pytest.mark.parametrize("agent", clients.AGENTS, ids=lambda a: a.name)
def test_two_step_task(
    agent: clients.Agent,
    target: clients.Target,
    agent_binaries: dict[str, Path],
    agents_gateway: AgentsGateway,
    agents_log: SessionLogReader,
    agent_runs: tuple[Path, list[Summary]],
) -> None:
    root, runs = agent_runs
    s = run_leg(
        agent,
        agent_binaries[agent.name],
        target,
        agents_gateway.url,
        agents_gateway.key,
        agents_log,
        root / f"{agent.name}-{target}",
    )
    runs.append(s)
    print(s.row())
    problems = s.problems()
    # the gateway's own count of what it answered on the generation routes
    answered = sum(s.gateway_statuses.values())
    if answered != s.requests:
        problems.append(f"the gateway answered {answered} requests, the agent made {s.requests}")
    problems += [
        f"the gateway answered {n} x {k}"
        for k, n in s.gateway_statuses.items()
        if not k.endswith(" 200")
    ]
    report = "\n".join(problems + s.notes + [f"gateway log: {agents_gateway.log}"])
    assert not problems, report
