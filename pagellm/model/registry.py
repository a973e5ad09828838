"""Which model class implements which Hugging Face `architectures` name."""

from __future__ import annotations

from pagellm.model.errors import UnsupportedArchitectureError
from pagellm.model.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class for an architecture name, or a clear error listing what is supported."""
    model_cls = MODEL_REGISTRY.get(architecture)
    if model_cls is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: "
            + ", ".join(sorted(MODEL_REGISTRY))
        )
    return model_cls
