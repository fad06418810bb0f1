#!/usr/bin/env bash
# Create .venv and install reshard with its trainer and test extras, at this platform's exact versions
# (constraints.txt; CPU torch from the pinned wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[trainer,test]" -c constraints.txt
