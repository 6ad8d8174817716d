#!/usr/bin/env bash
# TensorBoard on a run's event files (RUN_DIR/tensorboard), or on a folder of runs.
# Usage: scripts/dashboard.sh RUN_DIR [--port N] [--bind-all]   (default port 6006,
#        on 127.0.0.1; --bind-all serves other machines too)
# The live fleet page needs nothing of this: the learner serves it itself (docs/metrics.md).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ $# -eq 0 ] || [ ! -d "$1" ]; then
  echo "usage: $0 RUN_DIR [--port N] [--bind-all]   (RUN_DIR must exist)" >&2
  exit 2
fi
logdir=$1
shift
port=6006 host=127.0.0.1
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port=${2:?--port needs a number}; shift 2 ;;
    --bind-all) host=0.0.0.0; shift ;;
    *) echo "dashboard: unknown option $1" >&2; exit 2 ;;
  esac
done
"$root/scripts/setup.sh" --dashboard
echo "dashboard: TensorBoard on http://$host:$port/ for $logdir" >&2
exec "$root/.venv/bin/tensorboard" --logdir "$logdir" --host "$host" --port "$port"
