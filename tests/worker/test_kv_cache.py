"""Sizing the KV pool from its memory budget."""

from __future__ import annotations

import psutil
import pytest
import torch

from pagellm.model.model_config import ModelConfig
from pagellm.worker.kv_cache import num_blocks_for_budget

CONFIG = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256})


def test_a_budget_past_free_memory_is_refused_naming_the_option() -> None:
    """It was zero-filled until the OOM killer ended the process, with no message."""
    cpu = torch.device("cpu")
    blocks = num_blocks_for_budget(CONFIG, 16, torch.float32, cpu, kv_cache_memory_bytes=1 << 20)
    assert blocks == (1 << 20) // CONFIG.kv_cache_bytes_per_block(4) // 16
    too_much = psutil.virtual_memory().total * 2
    with pytest.raises(ValueError, match=r"--kv-cache-memory-bytes\) is .* GiB of memory free on cpu"):
        num_blocks_for_budget(CONFIG, 16, torch.float32, cpu, kv_cache_memory_bytes=too_much)


def test_a_pool_in_blocks_takes_that_many_whatever_its_element_type() -> None:
    """vLLM's num_gpu_blocks_override: a pool sized in tokens (benchmarks, eviction
    tests) whether "auto" turned out float32 or bfloat16; past free memory it is refused
    naming the option, as a budget in bytes is."""
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        assert num_blocks_for_budget(CONFIG, 16, dtype, cpu, kv_cache_memory_bytes=1 << 20,
                                     num_blocks_override=7) == 7
    too_many = psutil.virtual_memory().total // (CONFIG.kv_cache_bytes_per_block(4) * 16) * 2
    with pytest.raises(ValueError, match=r"--num-gpu-blocks-override\) needs .* GiB, more "
                                         r"than the .* GiB of memory free on cpu"):
        num_blocks_for_budget(CONFIG, 16, torch.float32, cpu, num_blocks_override=too_many)
