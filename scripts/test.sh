#!/usr/bin/env bash
# Installs everything, then runs the linters and the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m ruff check pagellm tests benchmarks
python3 -m mypy pagellm benchmarks/*.py
# Tests write only under their temporary directories: a file they leave in the working
# tree (a fake compiler once wrote `--version` here) fails the run. Checked on a git
# checkout run as CI runs it (pytest options such as --junitxml write files of their own).
check_tree=""
if [ $# -eq 0 ] && git status --porcelain >/dev/null 2>&1; then
    check_tree=1
else
    echo "(the working-tree check is off: not a git checkout, or pytest options given)"
fi
tree() { git status --porcelain --untracked-files=all; }
before=$([ -n "$check_tree" ] && tree || true)
python3 -m pytest -q "$@"
if [ -n "$check_tree" ]; then
    after=$(tree)
    if [ "$before" != "$after" ]; then
        echo "the tests changed the working tree:"
        diff <(echo "$before") <(echo "$after") || true
        exit 1
    fi
fi
