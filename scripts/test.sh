#!/usr/bin/env bash
# Installs everything, then runs the linters and the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m ruff check pagellm tests benchmarks
python3 -m mypy pagellm
# Tests write only under their temporary directories: a file they leave in the working
# tree (a fake compiler once wrote `--version` here) fails the run.
tree() { git status --porcelain --untracked-files=all 2>/dev/null || true; }
before=$(tree)
python3 -m pytest -q "$@"
after=$(tree)
if [ "$before" != "$after" ]; then
    echo "the tests changed the working tree:"
    diff <(echo "$before") <(echo "$after") || true
    exit 1
fi
