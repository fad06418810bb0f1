#!/usr/bin/env bash
# Set up and run the main job end to end on a tiny embedded model (no downloads, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py
