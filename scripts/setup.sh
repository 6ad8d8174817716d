#!/usr/bin/env bash
# Makes .venv match uv.lock, installing uv first if this machine has none.
# Usage: scripts/setup.sh [--dev] [--bench] [--dashboard] [--eval] [--plot] [--football] [--cuda]
#   --dev: the test and codegen tools; --bench: the benchmark's plotting;
#   --dashboard: TensorBoard; --eval: seedrl-eval's video; --plot: learning curves;
#   --football: gfootball's Python dependencies (scripts/install_football.sh uses it);
#   --cuda: jax for NVIDIA GPUs, CUDA libraries included (the host needs only the driver)
# Sourced by run_local.sh and test.sh; safe to run again (a no-op when in sync).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UV_VERSION=0.13.9

extras=()
for flag in "$@"; do
  case "$flag" in
    --dev|--bench|--dashboard|--eval|--plot|--football|--cuda) extras+=(--extra "${flag#--}") ;;
    *) echo "usage: $0 [--dev] [--bench] [--dashboard] [--eval] [--plot] [--football] [--cuda]" >&2; exit 2 ;;
  esac
done

find_uv() {
  if command -v uv >/dev/null 2>&1; then echo uv; return; fi
  if [ -x "$root/.uv-bootstrap/bin/uv" ]; then echo "$root/.uv-bootstrap/bin/uv"; return; fi
  # A private venv keeps uv out of the system's Python.
  echo "setup: installing uv $UV_VERSION into .uv-bootstrap/" >&2
  python3 -m venv "$root/.uv-bootstrap" >&2
  "$root/.uv-bootstrap/bin/pip" install --quiet "uv==$UV_VERSION" >&2
  echo "$root/.uv-bootstrap/bin/uv"
}

uv=$(find_uv)
cd "$root"
# The lock file decides every version; python-downloads=never (pyproject) keeps
# uv to this machine's Python 3.11; --inexact keeps the dev tools when training
# after testing. --compile-bytecode writes the packages' .pyc files once, here:
# where PYTHONDONTWRITEBYTECODE is set (containers, CI), Python never writes them
# and would compile jax, flax and the rest again in every process it starts, about
# half of a learner's or an actor's start-up.
"$uv" sync --frozen --inexact --compile-bytecode ${extras[@]+"${extras[@]}"} --quiet
# The project's own modules, imported from this tree (an editable install), the same.
.venv/bin/python -m compileall -q -j 0 seedrl envs actors learner bench >/dev/null
# The policy's oneDNN convolution is compiled when the package is built
# (hatch_build.py). uv rebuilds the package when its source changes, not when
# the ignored library has gone (git clean, a copy without ignored files).
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] && [ ! -e learner/backends/cpu/native/libseedrl_onednn.so ]; then
  "$uv" sync --frozen --inexact --compile-bytecode ${extras[@]+"${extras[@]}"} --reinstall-package seedrl --quiet
fi
