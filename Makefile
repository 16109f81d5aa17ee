# Two commands on a fresh machine:
#   make serve   set up .venv if needed, then run the gateway on 127.0.0.1:8000
#   make test    set up .venv if needed, then lint, type check and the full test suite
VENV := .venv
BIN := $(VENV)/bin
SERVE_ARGS ?=

.PHONY: setup serve test lint typecheck unit stores processes network integration config-docs bench bench-memory bench-render bench-proxy bench-workers bench-frontend bench-routes fuzz loadtest loadtest-control loadtest-agents agents clean

setup:
	@bash scripts/setup.sh

serve: setup
	$(BIN)/vcache serve $(SERVE_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy
	$(BIN)/mypy --strict manifest

# the test tiers (docs/development.md): hermetic (no network, stores, processes or sleeps
# that order events); PostgreSQL and Redis; processes of their own; the internet.
# `make test` runs every tier.
unit: setup
	$(BIN)/python -m pytest tests/unit -q

stores: setup
	$(BIN)/python -m pytest -q -m stores

processes: setup
	$(BIN)/python -m pytest -q -m processes

network: setup
	$(BIN)/python -m pytest -q -m network

integration: setup
	$(BIN)/python -m pytest tests/integration -q

test: lint typecheck
	$(BIN)/python -m coverage run -m pytest -q
	$(BIN)/python -m coverage report --include='manifest/*' --fail-under=95

bench: setup
	$(BIN)/python -m loadtests.bench_manifest

bench-memory: setup
	$(BIN)/python -m loadtests.bench_memory

bench-render: setup
	$(BIN)/python -m loadtests.bench_render $(RENDER_ARGS)

bench-workers: setup
	$(BIN)/python -m loadtests.bench_workers $(WORKERS_ARGS)

bench-frontend: setup
	$(BIN)/python -m loadtests.bench_frontend $(FRONTEND_ARGS)

bench-routes: setup
	$(BIN)/python -m loadtests.bench_routes $(ROUTES_ARGS)

bench-proxy: setup
	@bash scripts/litellm_venv.sh
	$(BIN)/python -m loadtests.bench_proxy --litellm .bench/litellm/bin/litellm $(PROXY_ARGS)

config-docs: setup
	$(BIN)/python scripts/gen_config_docs.py

fuzz: setup
	$(BIN)/python -m scripts.fuzz_api

loadtest: setup
	$(BIN)/python -m loadtests.run $(LOADTEST_ARGS)

loadtest-control: setup
	$(BIN)/python -m loadtests.control_arms $(CONTROL_ARGS)

loadtest-agents: setup
	$(BIN)/python -m loadtests.agent_sessions $(AGENTS_ARGS)

# the agent tier: the Codex CLI and Claude Code (pinned, from the npm registry) against a
# gateway of its own (docs/agents_tier.md)
agents: setup
	$(BIN)/python -m pytest tests/agents -q -rxX

clean:
	rm -rf $(VENV) .bench .vcache-test-data .mypy_cache .ruff_cache .pytest_cache
