#!/usr/bin/env bash
# The benchmark: raw env, serving capacity, end to end, network compute vs PyTorch.
# Usage: scripts/bench.sh [--cases abcde] [--short] [--out-dir DIR] [--duration-s S] ...
#        (python -m bench --help lists every option)
#        scripts/bench.sh learn [--games Pong Breakout ...] [--time-limit-min M] ...
#        (minutes to a score with the README's train command: python -m bench.learn --help)
#        scripts/bench.sh attacks [--window-s S] [--attacks NAME ...]
#        (a training learner under hostile peers, an honest actor beside it)
# Prints a table per case; writes DIR/results.json and PNG plots (default DIR:
# runs/bench-TIMESTAMP). About 11-14 minutes on 2 cores by default.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh --bench
if [ "${1:-}" = learn ]; then
  shift
  exec .venv/bin/python -m bench.learn "$@"
fi
if [ "${1:-}" = attacks ]; then
  shift
  exec .venv/bin/python -m bench.attacks "$@"
fi
# PyTorch is case (e)'s yardstick only, never a dependency of seedrl: it goes into
# .venv beside the locked packages when pip can find it, and (e) says so when not.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "bench: installing torch==2.13.0 (CPU) into .venv as case (e)'s yardstick" >&2
  python3 -m pip --python .venv/bin/python install --quiet "torch==2.13.0" >&2 \
    || echo "bench: could not install torch; case (e) runs without its yardstick" >&2
fi
exec .venv/bin/python -m bench "$@"
