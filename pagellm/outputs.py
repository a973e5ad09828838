"""vLLM's import path `vllm.outputs`; the definitions are in `pagellm.engine.outputs`."""

from pagellm.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "RequestOutput"]
