"""PageLLM: an LLM inference engine built around a paged KV cache with prefix caching.

The public names are imported lazily so that `pagellm.core` (pure Python) can be used
and tested without importing torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# torch's OpenMP threads spin for a long time (GNU OpenMP: 300,000 iterations) waiting for
# the next parallel region. As soon as another process wants a core (a benchmark client, a
# test runner, a second server) that spinning made a step 5-10x slower here. A short spin
# keeps most of the quiet-machine speed (passive waiting was 25% slower per decode step) and
# none of the collapse. OpenMP reads this once, when torch loads it, so it is set here,
# before PageLLM imports torch; a value the user set is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

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
