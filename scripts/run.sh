#!/usr/bin/env bash
# Installs everything, then runs the main job: the default model answering two questions
# that share a system prompt, printing how much of the second prompt came from the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 examples/quickstart.py
