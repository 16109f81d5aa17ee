#!/usr/bin/env bash
# Generate the Python gRPC stubs from protos/ into gateway/grpc/api/ (never edit them by hand).
# The virtual include path makes the generated modules import each other as
# gateway.grpc.api.*, while the proto package stays vcache.v1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m grpc_tools.protoc \
  -Igateway/grpc/api=protos/vcache/v1 \
  --python_out=. --grpc_python_out=. --pyi_out=. \
  gateway/grpc/api/gateway.proto
