#!/usr/bin/env bash
# Set up and run the tests (CPU only; Megatron-Core runs under torchrun with gloo).
#   bash scripts/test.sh          the fast tier: every module and format, one test against each outside oracle
#   bash scripts/test.sh --full   everything (what CI runs)
# Two workers (pytest-xdist) by default: most tests use one core at a time; -n 0 runs them one by one.
# Any further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
tier=(-m "fast or not slow")
if [ "${1:-}" = "--full" ]; then
  tier=()
  shift
fi
exec .venv/bin/python -m pytest -q -n 2 tests "${tier[@]}" "$@"
