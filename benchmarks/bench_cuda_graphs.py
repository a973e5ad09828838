"""Decode steps on a GPU: replayed from CUDA graphs against launched op by op.

For each batch size and prompt length, the same greedy requests run through an engine
with graphs and one with `enforce_eager`, side by side in one process; a decode step's
time is the median gap between a request's consecutive tokens. Then one configuration's
decode steps run the graphs' fixed-shape path eagerly under torch's profiler, to show
where a step's GPU time goes. Needs a CUDA device:

    python benchmarks/bench_cuda_graphs.py MODEL_DIR [--out results.md]
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch

from pagellm import LLM, SamplingParams
from pagellm.worker.cuda_graphs import CudaGraphRunner

BATCHES = (1, 8, 32, 64)
PROMPT_LENS = (128, 1024)
NEW_TOKENS = 48
# Room for the largest batch without preemption (64 x 1,072 tokens of the default model's
# shape is ~3 GiB of float32 K/V), and prompts prefilled in few steps.
ENGINE = dict(skip_tokenizer_init=True, max_num_seqs=max(BATCHES), max_num_batched_tokens=4096,
              kv_cache_memory_bytes=6 << 30)


def _prompts(batch: int, length: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]}
            for _ in range(batch)]


def decode_step_ms(llm: LLM, batch: int, length: int) -> float:
    """Median gap between consecutive tokens of every request, in ms (a second, warm run:
    the first captures the graphs its shapes need)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    gaps: list[float] = []
    for seed in (0, 1):
        outputs = llm.generate(_prompts(batch, length, seed), params, use_tqdm=False)
    for out in outputs:
        times = out.metrics.token_times if out.metrics is not None else []
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return 1000 * statistics.median(gaps)


def profile_fixed_shape_step(model: str, batch: int, length: int) -> str:
    """torch's profiler over decode steps that run the graphs' path eagerly: the prompts
    are cached by a first run, so every profiled step computes one token per request."""
    original = CudaGraphRunner._record
    CudaGraphRunner._record = lambda self, step: step  # type: ignore[method-assign]
    try:
        llm = LLM(model, **ENGINE)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate(_prompts(batch, length, 0), params, use_tqdm=False)
        with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU,
                            torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(_prompts(batch, length, 0), params, use_tqdm=False)
        table: str = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
        return table
    finally:
        CudaGraphRunner._record = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model directory (random weights do: speed only)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    engines = {name: LLM(args.model, enforce_eager=eager, **ENGINE)
               for name, eager in (("graphs", False), ("eager", True))}
    lines = ["| batch | prompt tokens | decode step, graphs (ms) | eager (ms) | speed-up |",
             "|---|---|---|---|---|"]
    for length in PROMPT_LENS:
        for batch in BATCHES:
            graphs = decode_step_ms(engines["graphs"], batch, length)
            eager = decode_step_ms(engines["eager"], batch, length)
            lines.append(f"| {batch} | {length} | {graphs:.2f} | {eager:.2f} | "
                         f"{eager / graphs:.2f}x |")
            print(lines[-1], flush=True)
    runner = engines["graphs"].llm_engine.runner.graphs
    lines.append(f"\nGraphs captured: {runner.num_graphs if runner else 0}")
    del engines
    lines.append("\nProfile of the fixed-shape decode path run eagerly, 32 x 1,024:\n")
    lines.append(profile_fixed_shape_step(args.model, 32, 1024))
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
