#!/usr/bin/env bash
# Regenerates the Python code for protos/ into seedrl/proto/ (or into OUT_DIR).
# The generated files are committed; tests/test_protos.py fails when they are
# stale. Usage: scripts/gen_protos.sh [OUT_DIR]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root}
if [ $# -gt 1 ]; then
  echo "usage: $0 [OUT_DIR]   (default: the repository root)" >&2
  exit 2
fi
python=${PYTHON:-$root/.venv/bin/python}
if ! "$python" -c 'import grpc_tools' 2>/dev/null; then
  echo "error: grpcio-tools is missing for $python; run scripts/test.sh once (it installs the dev extra)" >&2
  exit 1
fi
mkdir -p "$out/seedrl/proto"
cd "$root/protos"
"$python" -m grpc_tools.protoc -I . \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  seedrl/proto/*.proto
