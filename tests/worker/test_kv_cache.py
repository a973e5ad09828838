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
    assert blocks == (1 << 20) // CONFIG.kv_cache_bytes_per_token(4) // 16
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
    too_many = psutil.virtual_memory().total // (CONFIG.kv_cache_bytes_per_token(4) * 16) * 2
    with pytest.raises(ValueError, match=r"--num-gpu-blocks-override\) needs .* GiB, more "
                                         r"than the .* GiB of memory free on cpu"):
        num_blocks_for_budget(CONFIG, 16, torch.float32, cpu, num_blocks_override=too_many)


def test_gpu_memory_utilization_is_a_share_of_all_memory_less_what_is_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's meaning (its CPU build's too): the engine takes that share of the device's
    whole memory, the model included, so the pool is the share less what the engine
    already holds; a share past what was free when it began is refused, as vLLM refuses
    it; an explicit byte budget wins, as in vLLM."""
    from pagellm.worker import kv_cache

    cpu = torch.device("cpu")
    per_block = CONFIG.kv_cache_bytes_per_token(4) * 16
    monkeypatch.setattr(kv_cache, "device_memory_bytes",
                        lambda device: (60 * per_block, 100 * per_block))
    monkeypatch.setattr(kv_cache, "used_memory_bytes", lambda device, free: 30 * per_block)

    def blocks(utilization: float, **kwargs: int) -> int:
        return num_blocks_for_budget(CONFIG, 16, torch.float32, cpu,
                                     memory_utilization=utilization,
                                     free_at_start=95 * per_block, **kwargs)

    assert blocks(0.5) == 20
    assert blocks(0.5, kv_cache_memory_bytes=3 * per_block) == 3
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.3 \(--gpu-memory-"
                                         r"utilization\) gives this engine .* GiB of the .* "
                                         r"GiB on cpu, and the model and torch already take "
                                         r".* no room"):
        blocks(0.3)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.97 .*, more than the .* "
                                         r"GiB free when it began"):
        blocks(0.97)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.93 .*: a .* GiB KV pool, "
                                         r"more than the .* GiB of memory free on cpu"):
        blocks(0.93)


def test_on_a_gpu_the_engine_counts_only_its_own_memory(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """As vLLM counts it: what the card lost since the engine began, so that two engines
    at 0.45 share one card whatever else runs there."""
    from pagellm.worker import kv_cache

    monkeypatch.setattr(kv_cache, "device_memory_bytes", lambda device: (50 << 30, 80 << 30))
    assert kv_cache.used_memory_bytes(torch.device("cuda"), free_at_start=52 << 30) == 2 << 30


def test_the_whole_memory_is_the_containers_where_it_is_limited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pagellm import cgroup_limits
    from pagellm.worker import kv_cache

    monkeypatch.setattr(cgroup_limits, "memory_limit", lambda: 1 << 30)
    monkeypatch.setattr(cgroup_limits, "memory_available", lambda: 1 << 29)
    assert kv_cache.device_memory_bytes(torch.device("cpu")) == (1 << 29, 1 << 30)
    monkeypatch.setattr(cgroup_limits, "memory_limit", lambda: None)
    monkeypatch.setattr(cgroup_limits, "memory_available", lambda: None)
    assert kv_cache.device_memory_bytes(torch.device("cpu"))[1] == psutil.virtual_memory().total
