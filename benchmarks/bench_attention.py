"""Attention backends side by side on SmolLM2-135M attention shapes (ratios vs torch_ref).

One step is what the model does with attention per forward: build the backend's plan
once, then, per layer, write the new K/V into the paged cache and attend. Steps are timed
whole (plan + all layers), the median of a few, on the same inputs for every backend.

    python benchmarks/bench_attention.py [--repeats 3] [--layers 30] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from pagellm.model.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionSpec,
    allocate_kv_caches,
    get_attention_backend,
)
from pagellm.model.attention_metadata import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M

# scenario -> requests as (cached tokens, new tokens)
SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "decode 64 x ~1000 ctx": [(random.Random(i).randint(900, 1100), 1) for i in range(64)],
    "prefill over prefix 8 x (512 cached + 128 new)": [(512, 128)] * 8,
    "mixed: 1 chunk of 256 + 63 decodes ~1000 ctx": [(0, 256)]
    + [(random.Random(i).randint(900, 1100), 1) for i in range(63)],
    "skewed decodes: 1 x 8000 ctx + 63 x ~100 ctx": [(8000, 1)]
    + [(random.Random(i).randint(50, 150), 1) for i in range(63)],
}


def build_case(
    shapes: list[tuple[int, int]], seed: int = 0
) -> tuple[AttentionMetadata, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Metadata with shuffled block tables, a random-filled cache, and the step's q/k/v."""
    blocks_per_req = [-(-(c + q) // BLOCK_SIZE) for c, q in shapes]
    num_blocks = sum(blocks_per_req) + 8
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_req]
    width = max(blocks_per_req)
    slots = torch.cat(
        [
            torch.tensor(table)[torch.arange(c, c + q) // BLOCK_SIZE] * BLOCK_SIZE
            + torch.arange(c, c + q) % BLOCK_SIZE
            for table, (c, q) in zip(tables, shapes, strict=True)
        ]
    )
    q_lens = [q for _, q in shapes]
    seq_lens = [c + q for c, q in shapes]
    qsl = torch.tensor([0, *q_lens]).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl.to(torch.int32),
        context_lens=torch.tensor([c for c, _ in shapes], dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK_SIZE,
        seq_lens_list=seq_lens,
        query_lens_list=q_lens,
    )
    shape = (2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = allocate_kv_caches(1, shape, torch.float32, "cpu")[0]
    cache.normal_()
    tokens = sum(q_lens)
    qkv = (
        torch.randn(tokens, HEADS, HEAD_DIM),
        torch.randn(tokens, KV_HEADS, HEAD_DIM),
        torch.randn(tokens, KV_HEADS, HEAD_DIM),
    )
    return meta, cache, qkv


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_step(
    backend: AttentionBackend,
    meta: AttentionMetadata,
    cache: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    spec: AttentionSpec,
    layers: int,
) -> None:
    """One model step's attention work: plan once, then every layer writes and attends."""
    plan = backend.prepare(meta)
    for _ in range(layers):
        backend.forward(*qkv, cache, plan, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30, help="layers per step (SmolLM2: 30)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, block size {BLOCK_SIZE}")
    with torch.inference_mode():
        for scenario, shapes in SCENARIOS.items():
            meta, cache, (q, k, v) = build_case(shapes)
            print(f"\n{scenario}  ({q.shape[0]} new tokens, {sum(meta.seq_lens_list)} keys)")
            per_step: dict[str, float] = {}
            for name in sorted(ATTENTION_BACKENDS):
                backend = get_attention_backend(name)
                step = partial(run_step, backend, meta, cache, (q, k, v), spec, args.layers)
                per_step[name] = timed(step, args.repeats)
                print(
                    f"  {name:14s} step {per_step[name] * 1e3:9.1f} ms   "
                    f"per layer {per_step[name] / args.layers * 1e3:7.2f} ms"
                )
            reference = per_step["torch_ref"]
            for name, seconds in sorted(per_step.items()):
                if name != "torch_ref":
                    print(f"  {name} vs torch_ref: x{reference / seconds:.2f} faster")


if __name__ == "__main__":
    main()
