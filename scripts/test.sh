#!/usr/bin/env bash
# Installs everything, then runs the linters and the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m ruff check pagellm tests benchmarks
python3 -m mypy pagellm
python3 -m pytest -q "$@"
