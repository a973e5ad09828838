"""ModelConfig parsing: both rope spellings, architecture traits, token ids, cache shape."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_sim import PagedSim
from transformers import LlamaConfig, LlamaForCausalLM

from pagellm.model import SUPPORTED_ARCHITECTURES, ModelConfig, get_model_class, load_model
from pagellm.model.errors import ModelLoadError

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


def make(**changes: Any) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **changes})


def test_shapes_and_kv_cache_layout() -> None:
    config = make()
    assert config.head_dim == 8
    assert config.num_layers == 3 and config.num_kv_heads == 2
    assert config.kv_cache_shape(10, 16) == (2, 10, 16, 2, 8)
    assert config.kv_cache_bytes_per_token(2) == 3 * 2 * 2 * 8 * 2


def test_old_style_rope_scaling() -> None:
    config = make(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_new_style_rope_parameters() -> None:
    params = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = make(rope_parameters=params)
    assert config.rope_theta == 5e5
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
    assert make(rope_parameters={"rope_type": "default", "rope_theta": 1e4}).rope_scaling is None


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_scaling": {"rope_type": "linear"}}, "rope type 'linear' needs 'factor'"),
    ({"rope_scaling": {"type": "linear", "factor": "2"}}, "needs 'factor', a positive number"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
     "rope type 'llama3' needs 'low_freq_factor'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config (quant_method 'gptq') is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'"),
])
def test_configs_this_engine_cannot_run_are_refused_by_name(changes: dict[str, Any],
                                                            message: str) -> None:
    """Not a KeyError deep in the rope code, nor a quantized tensor reported as a
    corrupt checkpoint: the config's own field, named."""
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        make(**changes)


def test_architecture_traits() -> None:
    qwen2 = make(architectures=["Qwen2ForCausalLM"])
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = make(architectures=["Qwen3ForCausalLM"], head_dim=32)
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    llama = make(attention_bias=True)
    assert llama.attention_bias and llama.o_proj_bias
    mistral = make(architectures=["MistralForCausalLM"], sliding_window=4096)
    assert mistral.layer_types == ("sliding_attention",) * 3
    assert mistral.layer_sliding_window(0) == 4096
    assert (
        make(architectures=["MistralForCausalLM"], sliding_window=None).layer_sliding_window(0)
        is None
    )


def test_qwen_sliding_window_follows_use_sliding_window() -> None:
    off = make(architectures=["Qwen2ForCausalLM"], sliding_window=4096, use_sliding_window=False)
    assert off.sliding_window is None and set(off.layer_types) == {"full_attention"}
    on = make(
        architectures=["Qwen2ForCausalLM"],
        sliding_window=64,
        use_sliding_window=True,
        max_window_layers=1,
    )
    assert on.layer_types == ("full_attention", "sliding_attention", "sliding_attention")


def test_eos_ids_merge_generation_config() -> None:
    config = ModelConfig.from_dict(
        {**BASE, "eos_token_id": 2, "bos_token_id": 1},
        generation_config={"eos_token_id": [2, 7]},
    )
    assert config.eos_token_ids == (2, 7)
    assert config.bos_token_id == 1


def test_registry_covers_every_supported_architecture() -> None:
    for arch in SUPPORTED_ARCHITECTURES:
        assert get_model_class(arch) is not None


def test_bfloat16_load_runs_close_to_float32(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf_config = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"})
    LlamaForCausalLM(hf_config).save_pretrained(tmp_path)
    tokens = list(range(1, 20))
    full = PagedSim(load_model(tmp_path, "float32")).step([("r", tokens)])
    half_model = load_model(tmp_path, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in half_model.parameters())
    half = PagedSim(half_model).step([("r", tokens)])
    assert half.dtype == torch.float32
    assert (half - full).abs().max().item() < 0.05
