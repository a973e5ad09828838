"""The KV tensors: sized once from a memory budget, then handed to every forward pass."""

from __future__ import annotations

import logging

import psutil
import torch

from pagellm import cgroup_limits
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Without an explicit budget, take this share of the memory that is free at start-up.
DEFAULT_MEMORY_FRACTION = 0.25
# A bigger default pool buys nothing for one CPU process and only slows start-up (the
# tensors are zero-filled); an explicit budget is never capped.
DEFAULT_MAX_POOL_BYTES = 1 << 30


def device_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) memory of `device`; on the CPU, within the container's memory limit
    too (the total is what vLLM's gpu_memory_utilization is a share of)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    memory = psutil.virtual_memory()
    free, total = int(memory.available), int(memory.total)
    available, limit = cgroup_limits.memory_available(), cgroup_limits.memory_limit()
    return (free if available is None else min(free, available),
            total if limit is None else min(total, limit))


def used_memory_bytes(device: torch.device, free_at_start: int) -> int:
    """Memory this engine holds before its pool, as vLLM counts its own: on the CPU the
    process's resident memory (the model's weights, torch, Python); on a GPU what the
    card lost since the engine began (`free_at_start`: the weights, the CUDA context's
    growth), not other processes' memory."""
    if device.type == "cuda":
        return max(0, free_at_start - device_memory_bytes(device)[0])
    return int(psutil.Process().memory_info().rss)


def num_blocks_for_budget(
    model_config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    num_blocks_override: int | None = None,
    memory_utilization: float | None = None,
    free_at_start: int | None = None,
) -> int:
    """How many blocks the pool has: `num_blocks_override` if given (vLLM's
    num_gpu_blocks_override: a pool sized in tokens, whatever its element type), else
    what fits in explicit bytes, else in what `memory_utilization` (vLLM's
    gpu_memory_utilization: this engine's share of all the device's memory, the model
    included) leaves once the model is loaded, else in a fraction of free memory.
    `free_at_start`: the device's free memory before the model was loaded (now, if
    not given)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    bytes_per_block = model_config.kv_cache_bytes_per_token(element_size) * block_size
    if num_blocks_override is not None:
        _check_free(num_blocks_override * bytes_per_block, device,
                    f"num_gpu_blocks_override={num_blocks_override} (--num-gpu-blocks-"
                    f"override) needs {num_blocks_override * bytes_per_block / 2**30:.1f} GiB")
        return num_blocks_override
    if kv_cache_memory_bytes is None and memory_utilization is not None:
        budget = _utilization_budget(
            memory_utilization, device, bytes_per_block,
            device_memory_bytes(device)[0] if free_at_start is None else free_at_start)
    elif kv_cache_memory_bytes is None:
        fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        budget = int(device_memory_bytes(device)[0] * fraction)
        if memory_fraction is None:
            budget = min(budget, DEFAULT_MAX_POOL_BYTES)
    else:
        budget = kv_cache_memory_bytes
        _check_free(budget, device, "kv_cache_memory_bytes (--kv-cache-memory-bytes) is "
                                    f"{budget / 2**30:.1f} GiB")
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={budget} holds no block: one block of {block_size} "
            f"tokens needs {bytes_per_block} bytes for this model"
        )
    return int(num_blocks)


def _utilization_budget(utilization: float, device: torch.device, bytes_per_block: int,
                        free_at_start: int) -> int:
    """The pool vLLM's gpu_memory_utilization gives: the engine's share of the device
    less what the engine already holds. Refused by name, as vLLM refuses them, where the
    share was more than was free when the engine began, or holds no block past the
    model."""
    total = device_memory_bytes(device)[1]
    share = int(total * utilization)
    what = (f"gpu_memory_utilization={utilization} (--gpu-memory-utilization) gives this "
            f"engine {share / 2**30:.1f} GiB of the {total / 2**30:.1f} GiB on {device}")
    if share > free_at_start:
        raise ValueError(f"{what}, more than the {free_at_start / 2**30:.1f} GiB free when "
                         "it began: give a smaller share, or free memory")
    used = used_memory_bytes(device, free_at_start)
    if share - used < bytes_per_block:
        raise ValueError(f"{what}, and the model and torch already take {used / 2**30:.1f} "
                         "GiB of it: no room for a KV block; give a larger share")
    _check_free(share - used, device, f"{what}: a {(share - used) / 2**30:.1f} GiB KV pool")
    return share - used


def _check_free(pool_bytes: int, device: torch.device, what: str) -> None:
    """The pool is zero-filled at start: past free memory the process is killed (the
    OOM killer, with no message) or torch fails deep in an allocation."""
    free = device_memory_bytes(device)[0]
    if pool_bytes > free:
        raise ValueError(f"{what}, more than the {free / 2**30:.1f} GiB of memory free on "
                         f"{device} after loading the model: give less")


class KVCache:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer.

    With `padding_block`, each tensor holds one block more, which the block pool never
    hands out (its id is `num_blocks`): the padding rows of a CUDA-graph decode step write
    their keys and values there, where no request reads them."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype, size_option: str, padding_block: bool = False) -> None:
        """`size_option` names what sized the pool, for the error that asks for less."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.padding_block = num_blocks if padding_block else None
        try:
            self.tensors = model.allocate_kv_caches(num_blocks + int(padding_block),
                                                    block_size, dtype)
        except RuntimeError as error:  # CUDA's OutOfMemoryError is one too
            if ("can't allocate memory" not in str(error)
                    and not isinstance(error, torch.OutOfMemoryError)):
                raise
            # Past an address-space limit (ulimit -v), or the card's memory: one line.
            detail = str(error).rpartition("DefaultCPUAllocator: ")[2].split("\n")[0]
            raise ValueError(f"cannot allocate the KV cache ({num_blocks} blocks): "
                             f"{detail}; give a smaller {size_option}") from None
        total = sum(t.numel() * t.element_size() for t in self.tensors)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB of %s%s",
            num_blocks, block_size, num_blocks * block_size, total / 2**20,
            str(dtype).removeprefix("torch."),
            " (with a padding block)" if padding_block else "",
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole blocks (src -> dst) in every layer: copy-on-write for forks."""
        if not pairs:
            return
        device = self.tensors[0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        for tensor in self.tensors:
            tensor[:, dst] = tensor[:, src]
