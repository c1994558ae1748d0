#!/usr/bin/env bash
# Runs the test suite (sets up .venv first). Extra arguments go to pytest: bash scripts/test.sh -k katz
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" --test
cd "$root"
exec .venv/bin/python -m pytest "$@"
