#!/usr/bin/env bash
# Set up and run the whole test suite (CPU only; Megatron-Core runs under torchrun with gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
