"""PageLLM: an LLM inference engine built around a paged KV cache with prefix caching.

The public names are imported lazily so that `pagellm.core` (pure Python) can be used
and tested without importing torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# OpenMP threads that spin while waiting for work make torch 5-10x slower as soon as any
# other process wants a core (a benchmark client, a test runner, a second server). Passive
# waiting costs little when the machine is quiet. OpenMP reads this once, when torch loads
# it, so it is set here, before PageLLM imports torch; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_EXPORTS = {
    "LLM": "pagellm.engine.llm",
    "LLMEngine": "pagellm.engine.llm_engine",
    "EngineConfig": "pagellm.engine.config",
    "SamplingParams": "pagellm.core.sampling_params",
    "RequestOutput": "pagellm.engine.outputs",
    "CompletionOutput": "pagellm.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
