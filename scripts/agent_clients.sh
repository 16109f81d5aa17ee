#!/usr/bin/env bash
# Run the agent tier's two-step tasks (Codex, Claude Code, opencode) against a running gateway
# and print requests / 2xx / cache reuse / predictions / rebuilds per agent and target.
#
#   scripts/agent_clients.sh [BASE_URL]          (default http://127.0.0.1:8000)
#
# Environment (all optional):
#   VCACHE_API_KEY                     the gateway key the agents send
#   VCACHE_AGENT_CODEX_VERSION         another Codex CLI version than the pinned one
#   VCACHE_AGENT_CLAUDE_CODE_VERSION   another Claude Code version than the pinned one
#   VCACHE_AGENT_OPENCODE_VERSION      another opencode version than the pinned one
#   VCACHE_AGENTS                      codex,claude-code,opencode (which agents)
#   VCACHE_AGENTS_TARGETS              local (default) and/or emulated
#   VCACHE_AGENTS_SESSION_LOG          the gateway's session log (default <data dir>/sessions.db)
#   VCACHE_DATA_DIR                    the gateway's data dir (its demo model)
# Exit status 0 when every run passes.  See docs/agents_tier.md.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m tests.agents.harness "${1:-http://127.0.0.1:8000}" "${@:2}"
