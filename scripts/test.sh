#!/usr/bin/env bash
# The test command: installs what it needs into .venv, lints, runs the whole suite.
# Usage: scripts/test.sh [PYTEST_ARGS...]   e.g. scripts/test.sh -m "not slow" -x
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh --dev
# An unattended upgrade or another install may hold apt's locks: wait for them.
apt=(apt-get -o DPkg::Lock::Timeout=600)
# The fleet page's test drives a real browser: Debian's Chromium, installed once.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing Debian's chromium for the fleet page's browser test" >&2
    { "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq chromium; } \
      >/dev/null || echo "test: could not install chromium" >&2
  else
    echo "test: no chromium, and no root to install it" >&2
  fi
fi
# With a browser here, its test must run, never skip.
if command -v chromium >/dev/null 2>&1; then export SEEDRL_REQUIRE_BROWSER=1; fi
# The multi-host test makes network namespaces (iproute2, root): where this
# machine can, that test must run, never skip.
# launch_fleet.sh's ssh transport is tested against real sshd on those hosts.
missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "test: installing Debian's ${missing[*]} for the multi-host tests" >&2
  { "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq "${missing[@]}"; } \
    >/dev/null || echo "test: could not install ${missing[*]}" >&2
fi
probe="seedrl-probe-$$"
if [ "$(id -u)" = 0 ] && ip netns add "$probe" 2>/dev/null; then
  ip netns del "$probe"
  export SEEDRL_REQUIRE_NETNS=1
fi
# Google Research Football's engine is built from source (minutes, once; uv caches the
# wheel) where this machine can install its Debian build packages: there its tests must
# run, never skip. SEEDRL_TEST_FOOTBALL=0 leaves it out.
if [ "${SEEDRL_TEST_FOOTBALL:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if scripts/install_football.sh; then
    export SEEDRL_REQUIRE_FOOTBALL=1
  else
    echo "test: could not build gfootball; its engine tests will skip" >&2
  fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# pytest exits 5 when it collects no tests; set -e makes that a failure too.
exec .venv/bin/python -m pytest "$@"
