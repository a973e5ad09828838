"""PageLLM: an LLM inference engine built around a paged KV cache with prefix caching.

The public names are imported lazily so that `pagellm.core` (pure Python) can be used
and tested without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from pagellm.process_tuning import tune_process

tune_process()

_EXPORTS = {
    "LLM": "pagellm.engine.llm",
    "LLMEngine": "pagellm.engine.llm_engine",
    "AsyncLLMEngine": "pagellm.engine.async_engine",
    "EngineConfig": "pagellm.engine.config",
    "EngineArgs": "pagellm.entrypoints.engine_args",
    "AsyncEngineArgs": "pagellm.entrypoints.engine_args",
    "RequestOutputKind": "pagellm.core.sampling_params",
    "SamplingParams": "pagellm.core.sampling_params",
    "BeamSearchParams": "pagellm.core.sampling_params",
    "BeamSearchOutput": "pagellm.engine.beam_search",
    "BeamSearchSequence": "pagellm.engine.beam_search",
    "StructuredOutputsParams": "pagellm.core.sampling_params",
    "RequestOutput": "pagellm.engine.outputs",
    "CompletionOutput": "pagellm.engine.outputs",
    "TextPrompt": "pagellm.inputs",
    "TokensPrompt": "pagellm.inputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return importlib.metadata.version("pagellm")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
