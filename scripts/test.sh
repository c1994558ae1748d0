#!/usr/bin/env bash
# Runs the test suite (sets up .venv first). Extra arguments go to pytest: bash scripts/test.sh -k katz
#   bash scripts/test.sh           # everything
#   bash scripts/test.sh --fast    # all but the statistical tests, those that start other processes and those
#                                  # whose fixtures train a model or run the whole planner
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" --test
cd "$root"
if [ "${1:-}" = "--fast" ]; then
    shift
    exec .venv/bin/python -m pytest -m "not statistical and not processes and not pipeline" "$@"
fi
exec .venv/bin/python -m pytest "$@"
