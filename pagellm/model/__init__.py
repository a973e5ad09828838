"""The model layer: model definitions, paged attention backends and weight loading.

Typical start-up (what the engine does):

    path = resolve_model_path(model_arg, cache_dir)       # HF dir; GGUF converted once
    config = load_model_config(path)
    tokenizer = load_tokenizer(path)
    model = load_model(path, dtype="float32", device="cpu", attention_backend=None)
    kv_caches = model.allocate_kv_caches(num_blocks, block_size)
"""

from pagellm.model.attention import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    AttentionBackend,
    allocate_kv_caches,
    get_attention_backend,
)
from pagellm.model.attention_metadata import AttentionMetadata
from pagellm.model.errors import (
    CacheWriteError,
    CorruptModelError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from pagellm.model.gguf_loader import convert_gguf
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import load_model, load_tokenizer, resolve_dtype
from pagellm.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, load_model_config
from pagellm.model.registry import get_model_class
from pagellm.model.resolve import default_model_file, resolve_model_path

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_ATTENTION_BACKEND",
    "SUPPORTED_ARCHITECTURES",
    "AttentionBackend",
    "AttentionMetadata",
    "CacheWriteError",
    "CorruptModelError",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelLoadError",
    "ModelNotFoundError",
    "UnsupportedArchitectureError",
    "allocate_kv_caches",
    "convert_gguf",
    "default_model_file",
    "get_attention_backend",
    "get_model_class",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_model_path",
]
