"""Side-by-side comparisons: every contender, one after another, on the same workload,
then ratios, greedy agreement and the targets, gathered into one report."""

from __future__ import annotations

import logging
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagellm.bench.compare import (
    HF_CONTINUOUS,
    HF_GENERATE,
    PAGELLM,
    PAGELLM_NOCACHE,
    VLLM,
    VLLM_NOCACHE,
    Comparison,
    add_ratios,
    agreement,
    evaluate_targets,
    run_precision,
)
from pagellm.bench.contender import Contender
from pagellm.bench.harness import OfflineRun, run_offline
from pagellm.bench.metrics import RunResult
from pagellm.bench.online import (
    ServerProcess,
    free_port,
    pagellm_server_command,
    run_online,
    vllm_server_command,
)
from pagellm.bench.report import PRECISION_KEY, BenchReport
from pagellm.bench.workloads import Tokenizer, Workload
from pagellm.engine.config import EngineConfig, default_device, resolve_device

logger = logging.getLogger(__name__)

CONTENDERS = (PAGELLM, PAGELLM_NOCACHE, HF_GENERATE, HF_CONTINUOUS, VLLM, VLLM_NOCACHE)



@dataclass
class BenchOptions:
    """How contenders are built: engine settings shared by PageLLM and vLLM, and the
    transformers batch size. `engine_kwargs` are `EngineConfig` fields (block_size,
    max_num_seqs, max_num_batched_tokens, kv_cache_memory_bytes, num_threads,
    scheduling_policy, device, enforce_eager)."""

    model_dir: Path
    contenders: tuple[str, ...] = CONTENDERS
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    hf_batch_size: int = 8
    vllm_python: str | None = None
    request_rate: float = math.inf
    seed: int = 0
    agreement_requests: int = 8
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        unknown = [c for c in self.contenders if c not in CONTENDERS]
        if unknown:
            raise ValueError(f"unknown contender(s) {', '.join(unknown)}; choose from "
                             f"{', '.join(CONTENDERS)}")
        if self.agreement_requests < 0:
            raise ValueError("agreement_requests must be >= 0")
        budget = self.engine_kwargs.get("max_num_batched_tokens")
        seqs = self.engine_kwargs.get("max_num_seqs", EngineConfig.max_num_seqs)
        runs_vllm = self.vllm_python is not None and {VLLM, VLLM_NOCACHE} & set(self.contenders)
        if runs_vllm and budget is not None and budget < seqs:
            # Refused here, not by vLLM after PageLLM's runs and its minutes of start-up.
            raise ValueError(f"vLLM refuses --max-num-batched-tokens {budget} below "
                             f"--max-num-seqs {seqs}: give at least {seqs}, or leave the vLLM "
                             "contenders out")

    def engine_setting(self, name: str) -> Any:
        """The value PageLLM runs with: the one given, else EngineConfig's default for
        this device. vLLM is given the same, so neither engine wins by batching
        differently."""
        if name in self.engine_kwargs:
            return self.engine_kwargs[name]
        config = EngineConfig(**self.engine_kwargs)
        return config.step_budget() if name == "max_num_batched_tokens" else getattr(config, name)

    @property
    def max_num_seqs(self) -> int:
        return int(self.engine_setting("max_num_seqs"))

    @property
    def device(self) -> str:
        """Where PageLLM and transformers run: a ratio between them means something only
        on the same device (vLLM's CPU build stays on the CPU)."""
        return default_device(self.engine_kwargs.get("device"))


def _offline_contender(name: str, options: BenchOptions) -> Contender:
    from pagellm.bench.hf_runner import HFContinuousBatchingContender, HFGenerateContender
    from pagellm.bench.pagellm_runner import PageLLMContender
    from pagellm.bench.vllm_runner import DEFAULT_POOL_BYTES, VLLMContender

    threads = options.engine_kwargs.get("num_threads")
    if name in (PAGELLM, PAGELLM_NOCACHE):
        return PageLLMContender(name, options.model_dir, name == PAGELLM, options.engine_kwargs)
    if name == HF_GENERATE:
        return HFGenerateContender(name, options.model_dir, options.hf_batch_size, threads,
                                   options.device)
    if name == HF_CONTINUOUS:
        return HFContinuousBatchingContender(
            name, options.model_dir,
            max_batch_tokens=int(options.engine_setting("max_num_batched_tokens")),
            pool_bytes=int(options.engine_kwargs.get("kv_cache_memory_bytes")
                           or DEFAULT_POOL_BYTES),
            num_threads=threads, device=options.device)
    assert options.vllm_python is not None
    vllm_kwargs = {k: v for k, v in options.engine_kwargs.items()
                   if k in ("block_size", "kv_cache_memory_bytes")}
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        vllm_kwargs[key] = options.engine_setting(key)
    return VLLMContender(name, options.vllm_python, options.model_dir, name == VLLM,
                         vllm_kwargs, num_threads=threads)


def check_workload_fits(workload: Workload, options: BenchOptions) -> None:
    """Refuses, before any contender starts, requests the engines would refuse after
    loading: longer than the model's context, or than a KV pool given in bytes."""
    from pagellm.bench.pagellm_runner import kv_bytes_per_token
    from pagellm.model.model_config import load_model_config

    if not workload.prompts:
        return
    longest = max(len(prompt) for prompt in workload.prompts) + workload.output_len
    context = load_model_config(options.model_dir).max_position_embeddings
    if longest > context:
        raise ValueError(f"the workload's longest request is {longest:,} tokens (prompt and "
                         f"output), more than the model's {context:,}-token context: "
                         "give it shorter lengths")
    budget = options.engine_kwargs.get("kv_cache_memory_bytes")
    if budget and workload.kv_cache_tokens is None:
        block = int(options.engine_setting("block_size"))
        # The smallest pool in tokens of the contenders.
        element = max(_pool_element_size(name, options) for name in options.contenders)
        pool = int(budget) // (kv_bytes_per_token(options.model_dir, element) * block) * block
        if pool < longest:
            raise ValueError(f"--kv-cache-memory-bytes {budget:,} holds {pool:,} tokens, "
                             f"less than the workload's longest request ({longest:,} "
                             "tokens): give more")


def _skip_reason(name: str, mode: str, options: BenchOptions) -> str | None:
    if name in (VLLM, VLLM_NOCACHE) and not options.vllm_python:
        return f"{name} skipped: no --vllm-python given (vLLM's CPU build in its own venv)"
    if name == HF_CONTINUOUS and mode == "offline":
        from pagellm.bench.hf_runner import has_continuous_batching

        if not has_continuous_batching():
            return f"{name} skipped: this transformers has no generate_batch"
    if mode == "online" and name in (HF_GENERATE, HF_CONTINUOUS):
        return f"{name} skipped online: transformers is compared offline only"
    return None


def check_something_runs(options: BenchOptions, modes: tuple[str, ...]) -> None:
    """Refuses a run in which a mode would have no contender (each skipped, for the
    reasons the error lists), before anything runs: its report would be empty tables."""
    for mode in modes:
        reasons = [_skip_reason(name, mode, options) for name in options.contenders]
        if all(reasons):
            raise ValueError(f"no contender can run {mode}: " + "; ".join(
                reason for reason in reasons if reason))


def _pool_element_size(name: str, options: BenchOptions) -> int:
    """Bytes of one element of contender `name`'s KV pool, at most: PageLLM's may be
    bfloat16 (`kv_cache_dtype`), the others' are float32."""
    from pagellm.bench.pagellm_runner import kv_element_size

    return kv_element_size(options.engine_kwargs) if name in (PAGELLM, PAGELLM_NOCACHE) else 4


def _server(name: str, options: BenchOptions, workload: Workload) -> ServerProcess:
    from pagellm.bench.pagellm_runner import kv_cache_bytes_for_tokens
    from pagellm.bench.vllm_runner import DEFAULT_POOL_BYTES, vllm_cpu_env, vllm_max_model_len
    from pagellm.core.kv_cache_manager import blocks_for_tokens

    port = free_port()
    # The client sends its own key; a key from the environment would lock it out.
    env = {k: v for k, v in os.environ.items() if k != "PAGELLM_API_KEY"}
    block_size = int(options.engine_kwargs.get("block_size", 16))
    kv_bytes = options.engine_kwargs.get("kv_cache_memory_bytes")
    if name in (VLLM, VLLM_NOCACHE):
        assert options.vllm_python is not None
        max_model_len = None
        if workload.kv_cache_tokens is not None:
            kv_bytes = kv_cache_bytes_for_tokens(options.model_dir, workload.kv_cache_tokens,
                                                 block_size)
            max_model_len = vllm_max_model_len(workload.kv_cache_tokens, block_size)
        # PageLLM's default pool is capped at 1 GiB; vLLM gets the same unless told. Its
        # legacy whole-GiB variable would override the exact size, so it is dropped.
        command = vllm_server_command(
            options.vllm_python, options.model_dir, port, name == VLLM,
            int(kv_bytes or DEFAULT_POOL_BYTES), options.max_num_seqs,
            int(options.engine_setting("max_num_batched_tokens")),
            int(options.engine_setting("block_size")), max_model_len)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(vllm_cpu_env(options.engine_kwargs.get("num_threads")))
        return ServerProcess(command, port, env)
    args: list[str] = []
    flags = {"block_size": "--block-size", "max_num_seqs": "--max-num-seqs",
             "max_num_batched_tokens": "--max-num-batched-tokens",
             "num_threads": "--num-threads", "scheduling_policy": "--scheduling-policy",
             "device": "--device", "kv_cache_dtype": "--kv-cache-dtype",
             "cache_dir": "--cache-dir"}
    for key, flag in flags.items():
        if options.engine_kwargs.get(key) is not None:
            args += [flag, str(options.engine_kwargs[key])]
    if workload.kv_cache_tokens is not None:
        args += ["--num-gpu-blocks-override",
                 str(blocks_for_tokens(workload.kv_cache_tokens, block_size))]
    elif kv_bytes:
        args += ["--kv-cache-memory-bytes", str(kv_bytes)]
    for key in ("enforce_eager", "quantize_activations"):
        if options.engine_kwargs.get(key):
            args.append("--" + key.replace("_", "-"))
    return ServerProcess(pagellm_server_command(options.model_dir, port, name == PAGELLM,
                                                args), port, env)


def _run_once(name: str, workload: Workload, mode: str, options: BenchOptions,
              tokenizer: Tokenizer) -> tuple[RunResult, OfflineRun | None]:
    if mode == "offline":
        run = run_offline(_offline_contender(name, options), workload, tokenizer)
        return run.result, run
    return run_online(name, _server(name, options, workload), workload, tokenizer,
                      options.request_rate, options.seed), None


def _median_run(results: list[RunResult]) -> RunResult:
    """The run with the median output throughput (of an odd count; the lower middle of
    an even one): one disturbed repeat on a shared machine moves the median little."""
    ordered = sorted(results, key=lambda r: r.output_tokens_per_s)
    chosen = ordered[(len(ordered) - 1) // 2]
    if len(results) > 1:
        figures = ", ".join(f"{r.output_tokens_per_s:.1f}" for r in results)
        chosen.notes.append(f"median of {len(results)} repeats by output tok/s ({figures})")
    return chosen


def run_comparison(workload: Workload, mode: str, options: BenchOptions, tokenizer: Tokenizer,
                   label: str | None = None) -> Comparison:
    """Every requested contender on `workload` in `mode`, one after another, `repeats`
    times (in reverse order on every other repeat, so no contender always runs first);
    each contender's median repeat is reported. A contender that cannot run here is
    skipped with a note; one that fails is noted and the others still run, so one broken
    engine never loses the whole comparison."""
    if mode not in ("offline", "online"):
        raise ValueError(f"mode must be offline or online, got {mode!r}")
    units = len(workload.conversations) if workload.is_multi_turn else workload.num_requests
    comparison = Comparison(label or workload.name, workload.name, mode, dict(workload.params),
                            min(units, options.max_num_seqs),
                            request_rate=options.request_rate if mode == "online" else None)
    params = workload.params
    if workload.name == "eviction" and \
            params["num_prefixes"] * params["prefix_len"] < 2 * params["kv_cache_tokens"]:
        comparison.notes.append(
            f"the prefixes total {params['num_prefixes'] * params['prefix_len']:,} tokens, "
            f"less than twice the {params['kv_cache_tokens']:,}-token pool (which holds at "
            "least four requests): little is evicted at these sizes")
    names = []
    for name in options.contenders:
        reason = _skip_reason(name, mode, options)
        if reason:
            comparison.notes.append(reason)
        else:
            names.append(name)
    results: dict[str, list[RunResult]] = {name: [] for name in names}
    offline_runs: dict[str, OfflineRun] = {}
    failed: set[str] = set()
    for repeat in range(options.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            if name in failed:
                continue
            logger.info("[%s/%s] %s (repeat %d) ...", comparison.label, mode, name, repeat + 1)
            try:
                result, offline = _run_once(name, workload, mode, options, tokenizer)
            except Exception as error:  # noqa: BLE001 - report it and go on with the others
                logger.exception("%s failed on %s", name, comparison.label)
                comparison.notes.append(f"{name} failed: {type(error).__name__}: {error}")
                failed.add(name)
                comparison.failed.append(name)
                continue
            results[name].append(result)
            if offline is not None:
                offline_runs.setdefault(name, offline)
            logger.info("[%s/%s] %s: %.1f output tok/s, mean TTFT %.3f s, hit rate %s",
                        comparison.label, mode, name, result.output_tokens_per_s,
                        result.ttft["mean"], result.hit_rate)
    comparison.runs = [_median_run(results[name]) for name in names if results[name]]
    add_ratios(comparison)
    if offline_runs and options.agreement_requests:
        reference = offline_runs[comparison.runs[0].contender]
        for name, run in offline_runs.items():
            comparison.agreement[name] = agreement(reference.records, run.records,
                                                   options.agreement_requests)
    return comparison


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _describe_device(options: BenchOptions) -> str:
    import torch

    device = resolve_device(options.device)
    text = options.device
    if device.type == "cuda":
        text += f" ({torch.cuda.get_device_name(device)})"
    if device.type != "cpu" and any(c in (VLLM, VLLM_NOCACHE) for c in options.contenders):
        text += "; vLLM-cpu on the CPU"
    return text


def describe_environment(options: BenchOptions) -> dict[str, Any]:
    """What a reader needs to judge the numbers: when, on what, with which versions."""
    import torch
    import transformers

    from pagellm.model import cpu_kernels

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(sys.argv),
        "commit": _git_commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "device": _describe_device(options),
        "torch threads": torch.get_num_threads(),
        "PageLLM CPU kernels": cpu_kernels.instruction_set(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": str(options.model_dir),
        PRECISION_KEY: run_precision(options.engine_kwargs),
        "vLLM and transformers": "float32; every contender greedy",
        "engine settings": options.engine_kwargs or "defaults",
        "step budget (vLLM's too)": (f"{options.engine_setting('max_num_batched_tokens')} "
                                     f"tokens, {options.max_num_seqs} requests"),
        "transformers generate batch size": options.hf_batch_size,
        "seed": options.seed,
        "repeats": f"{options.repeats} (each contender's median run is shown)",
    }


def build_report(comparisons: list[Comparison], options: BenchOptions) -> BenchReport:
    return BenchReport(describe_environment(options), comparisons,
                       evaluate_targets(comparisons, run_precision(options.engine_kwargs)))
