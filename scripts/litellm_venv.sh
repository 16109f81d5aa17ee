#!/usr/bin/env bash
# LiteLLM proxy in a venv of its own (.bench/litellm): the peer that
# loadtests/bench_proxy.py measures vcache against.  Its [proxy] extra does not
# resolve on every package mirror (litellm-proxy missing), so the packages that
# `litellm --config` needs to start are named here.  Idempotent: a stamp keyed
# on the package list makes a second run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.bench/litellm
PACKAGES="litellm==1.110.2 fastapi uvicorn uvloop backoff orjson apscheduler pyjwt
  cryptography python-multipart email-validator rq gunicorn websockets semver expression
  fastapi-sso mcp soundfile"

stamp="$VENV/.stamp-$(echo "$PACKAGES" | sha256sum | cut -c1-12)"
if [ -f "$stamp" ] && [ -x "$VENV/bin/litellm" ]; then
  exit 0
fi
echo "litellm: installing LiteLLM proxy into $VENV" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC2086  # one word per package
"$VENV/bin/python" -m pip install --quiet $PACKAGES
rm -f "$VENV"/.stamp-*
touch "$stamp"
