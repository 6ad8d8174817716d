#!/usr/bin/env bash
# Installs Google Research Football (gfootball) into the project's .venv, no Docker.
# Usage: scripts/install_football.sh
#
# What it does, each step skipped when already done (safe to run again):
#   1. the Debian packages the engine's C++ build needs (apt-get; root or sudo);
#   2. the `football` extra from uv.lock: the old `gym` API gfootball is written
#      against (0.25.2; 0.26 breaks its reset), `six` (imported, not declared),
#      and the build's own imports (psutil, setuptools, wheel);
#   3. gfootball 2.10.2 itself, whose build compiles the game engine with cmake:
#      4 min 37 s on the 2-core development machine, up to 20-30 minutes on
#      slower ones; logged to runs/install-football.log.
#      uv keeps the built wheel in its cache, so a later install takes seconds.
# Then `scripts/run_local.sh --env football:academy_empty_goal_close` trains.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
GFOOTBALL_VERSION=2.10.2
DEBIAN_PACKAGES=(
  cmake build-essential libgl1-mesa-dev libegl-dev
  libsdl2-dev libsdl2-image-dev libsdl2-ttf-dev libsdl2-gfx-dev
  libboost-python-dev libboost-thread-dev libboost-system-dev libboost-filesystem-dev
)

say() { echo "install_football: $*" >&2; }

# -- 1. Debian packages -------------------------------------------------------
missing=()
for package in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    say "this is not a Debian-family system; install the equivalents of: ${missing[*]}"
    exit 1
  fi
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { say "need root (or sudo) to install: ${missing[*]}"; exit 1; }
    sudo=(sudo)
  fi
  say "installing ${#missing[@]} Debian packages: ${missing[*]}"
  # An unattended upgrade or another install may hold apt's locks: wait for them.
  apt=(apt-get -o DPkg::Lock::Timeout=600)
  "${sudo[@]}" "${apt[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" "${apt[@]}" install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
else
  say "Debian packages: all ${#DEBIAN_PACKAGES[@]} present"
fi

# -- 2. the locked Python dependencies -----------------------------------------
say "syncing .venv with uv.lock (the football extra)"
"$root/scripts/setup.sh" --football
uv=$(command -v uv || echo "$root/.uv-bootstrap/bin/uv")

# -- 3. gfootball and its engine -----------------------------------------------
installed=$(.venv/bin/python - <<'EOF' 2>/dev/null || true
import importlib.metadata as metadata
try:
    import gfootball_engine  # noqa: F401  (the compiled engine imports, or this fails)
    print(metadata.version("gfootball"))
except Exception:
    pass
EOF
)
if [ "$installed" = "$GFOOTBALL_VERSION" ]; then
  say "gfootball $GFOOTBALL_VERSION: already installed, engine imports"
else
  mkdir -p runs
  log="$root/runs/install-football.log"
  say "building gfootball $GFOOTBALL_VERSION and its C++ engine (5-30 minutes the first"
  say "time, by the machine; seconds from uv's cache after that); log: $log"
  # No build isolation: the build script imports psutil and runs `python3`, so
  # both must be the venv's. The dependencies come from the lock (step 2), so
  # none are resolved here (opencv is the headless wheel, in the extra).
  started=$(date +%s)
  if ! PATH="$root/.venv/bin:$PATH" "$uv" pip install --python .venv/bin/python \
      --no-build-isolation --no-deps "gfootball==$GFOOTBALL_VERSION" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    say "the build failed; the whole log is $log"
    exit 1
  fi
  say "gfootball built and installed in $(( $(date +%s) - started )) s"
fi

# -- check ---------------------------------------------------------------------
.venv/bin/python -c "
from envs import football
env = football.make('academy_empty_goal_close', num_envs=1, seed=0)
env.reset()
env.close()
print('install_football: football:academy_empty_goal_close steps; ready')
"
