#!/usr/bin/env bash
# The test command: installs what it needs into .venv, lints, runs the whole suite.
# Usage: scripts/test.sh [PYTEST_ARGS...]   e.g. scripts/test.sh -m "not slow" -x
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh --dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# pytest exits 5 when it collects no tests; set -e makes that a failure too.
exec .venv/bin/python -m pytest "$@"
