#!/usr/bin/env bash
# Learning curves of one or more runs as a PNG: return over env frames, FPS over time.
# Usage: scripts/plot.sh RUN_DIR... [--out FILE.png] [--labels NAME...]
#        (default output: the first RUN_DIR/curves.png)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ $# -eq 0 ]; then
  echo "usage: $0 RUN_DIR... [--out FILE.png] [--labels NAME...]" >&2
  exit 2
fi
"$root/scripts/setup.sh" --plot
exec "$root/.venv/bin/python" -m learner.tools.plot "$@"
