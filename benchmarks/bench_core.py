"""Micro-benchmarks of the pure-Python KV cache bookkeeping (pagellm.core).

A script, not a test: `python benchmarks/bench_core.py [--quick]`. Prints one table of
measured figures against the targets. Every figure is the best of a few repeats (the
least disturbed by other load on the machine); the per-step figures also give the median.

What is measured:
- hashing: tokens/s through `BlockHasher.extend` and through `Request(...)` creation
  (which hashes the prompt), for SHA-256 (the default) and the fast option;
- prefix look-ups/s: `find_cached_prefix` of a 2,000-token prompt whose prefix is cached;
- allocate+free blocks/s: `KVCacheManager.allocate` of a 128-block request then `free`,
  and the same at the `BlockPool` level;
- decode step: 256 running requests each append one token, allocate room for it and
  publish newly full blocks (`append_output_token` + `allocate(req, 1)` +
  `cache_full_blocks`): the per-step bookkeeping the engine adds around a forward;
- prefill step: 32 new 2,000-token prompts sharing a 1,500-token prefix (create the
  requests, which hashes them; `find_cached_prefix`; `allocate`; `cache_full_blocks`;
  `free`), with the shared prefix already cached (warm) and not (cold: all 32 admitted in
  the same step, so none can hit the others).
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm.core.block_hash import BlockHasher  # noqa: E402
from pagellm.core.block_pool import BlockPool  # noqa: E402
from pagellm.core.kv_cache_manager import KVCacheManager  # noqa: E402
from pagellm.core.request import Request  # noqa: E402
from pagellm.core.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 32_000
PARAMS = SamplingParams()


def best_of(repeats: int, fn: Callable[[], object]) -> list[float]:
    """Wall times of `repeats` calls of fn, with the garbage collector paused."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


class Rows:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []
        self.missed: list[str] = []

    def add(self, name: str, value: float, unit: str, target: float | None = None,
            higher_is_better: bool = True, note: str = "") -> None:
        if target is None:
            verdict = ""
        else:
            ok = value >= target if higher_is_better else value <= target
            sign = ">=" if higher_is_better else "<="
            verdict = f"{sign} {fmt(target)} {unit}: {'ok' if ok else 'MISSED'}"
            if not ok:
                self.missed.append(name)
        self.rows.append((name, f"{fmt(value)} {unit}", verdict, note))

    def print(self) -> None:
        widths = [max(len(r[i]) for r in self.rows) for i in range(4)]
        header = ("benchmark", "measured", "target", "note")
        widths = [max(w, len(h)) for w, h in zip(widths, header, strict=True)]
        line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
        print(line)
        print("-" * len(line))
        for row in self.rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def fmt(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {suffix}"
    return f"{x:.3g}"


# --- benchmarks -------------------------------------------------------------------------


def bench_hashing(rows: Rows, total_tokens: int, repeats: int) -> None:
    rng = random.Random(0)
    prompt_len = 2000
    prompts = [tokens(rng, prompt_len) for _ in range(total_tokens // prompt_len)]
    n = len(prompts) * prompt_len
    for algorithm in ("sha256", "fast"):
        hasher = BlockHasher(BLOCK_SIZE, algorithm)
        root = hasher.root()

        def extend(hasher: BlockHasher = hasher, root: bytes = root) -> None:
            for prompt in prompts:
                hasher.extend([], root, prompt)

        def create(hasher: BlockHasher = hasher) -> None:
            for i, prompt in enumerate(prompts):
                Request(f"h{i}", prompt, PARAMS, hasher)

        t_extend = min(best_of(repeats, extend))
        t_create = min(best_of(repeats, create))
        target = 5e6 if algorithm == "sha256" else None
        rows.add(f"hash {algorithm}: BlockHasher.extend", n / t_extend, "tok/s", target,
                 note=f"{n / 1e6:.1f} M tokens, block_size {BLOCK_SIZE}")
        rows.add(f"hash {algorithm}: Request creation", n / t_create, "tok/s", target,
                 note="copies the prompt twice + hashes")


def bench_lookup(rows: Rows, repeats: int) -> None:
    rng = random.Random(1)
    manager = KVCacheManager(num_blocks=4096, block_size=BLOCK_SIZE)
    hasher = BlockHasher(BLOCK_SIZE)
    prefix = tokens(rng, 1500)
    warm = Request("warm", prefix + tokens(rng, 500), PARAMS, hasher)
    hits, num = manager.find_cached_prefix(warm)
    manager.allocate(warm, warm.num_tokens - num, hits)
    warm.num_computed_tokens = warm.num_tokens
    manager.cache_full_blocks(warm)
    manager.free(warm)
    probes = [Request(f"p{i}", prefix + tokens(rng, 500), PARAMS, hasher) for i in range(200)]
    loops = 20

    def lookups() -> None:
        find = manager.find_cached_prefix
        for _ in range(loops):
            for request in probes:
                find(request)

    t = min(best_of(repeats, lookups))
    n = loops * len(probes)
    hit_blocks = len(manager.find_cached_prefix(probes[0])[0])
    rows.add("find_cached_prefix (2,000-tok prompt)", n / t, "lookups/s",
             note=f"{hit_blocks}-block hit, {n * (hit_blocks + 1) / t / 1e6:.1f} M blocks/s")


def bench_alloc_free(rows: Rows, repeats: int) -> None:
    num_blocks = 8192
    blocks_per_request = 128
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    hasher = BlockHasher(BLOCK_SIZE, "fast")
    requests = [Request(f"a{i}", [1], PARAMS, hasher) for i in range(num_blocks // 128)]
    num_tokens = blocks_per_request * BLOCK_SIZE

    def manager_cycle() -> None:
        allocate, free = manager.allocate, manager.free
        for _ in range(10):
            for request in requests:
                allocate(request, num_tokens)
            for request in requests:
                free(request)

    t = min(best_of(repeats, manager_cycle))
    n = 10 * len(requests) * blocks_per_request
    rows.add("KVCacheManager allocate+free", n / t, "blocks/s", 1e6,
             note=f"{blocks_per_request} blocks per request, pool of {num_blocks}")

    pool = BlockPool(num_blocks)

    def pool_cycle() -> None:
        for _ in range(10):
            held = [pool.allocate(blocks_per_request) for _ in range(num_blocks // 128)]
            for blocks in held:
                pool.free(reversed(blocks))

    t = min(best_of(repeats, pool_cycle))
    rows.add("BlockPool allocate+free", n / t, "blocks/s", 1e6)

    # With eviction: every allocated block holds a hash and must leave the map.
    cached_pool = BlockPool(num_blocks)
    hashes = [i.to_bytes(32, "little") for i in range(num_blocks)]

    def evict_cycle() -> None:
        held = cached_pool.allocate(num_blocks)
        for block, block_hash in zip(held, hashes, strict=True):
            cached_pool.cache_block(block, block_hash, None, ())
        cached_pool.free(reversed(held))

    evict_cycle()
    t = min(best_of(repeats, evict_cycle))
    rows.add("BlockPool evict+cache+free", num_blocks / t, "blocks/s",
             note="each block evicted, re-hashed, freed")


def bench_decode_step(rows: Rows, num_requests: int, steps: int, repeats: int) -> None:
    rng = random.Random(2)
    prompt_len = 500
    per_request = (prompt_len + steps * repeats + 1) // BLOCK_SIZE + 2
    manager = KVCacheManager(num_blocks=num_requests * per_request, block_size=BLOCK_SIZE)
    hasher = BlockHasher(BLOCK_SIZE)
    running = []
    for i in range(num_requests):
        request = Request(f"d{i}", tokens(rng, prompt_len), PARAMS, hasher)
        hits, num = manager.find_cached_prefix(request)
        assert manager.allocate(request, request.num_tokens - num, hits) is not None
        request.num_computed_tokens = request.num_tokens
        manager.cache_full_blocks(request)
        request.append_output_token(rng.randrange(VOCAB))  # sampled: next step's input
        running.append(request)
    sampled = [rng.randrange(VOCAB) for _ in range(num_requests)]

    def step() -> None:
        allocate, cache = manager.allocate, manager.cache_full_blocks
        for request in running:  # schedule: room for the input token
            if allocate(request, 1) is None:
                raise RuntimeError("pool too small for the benchmark")
        for request, token in zip(running, sampled, strict=True):  # update after forward
            request.num_computed_tokens += 1
            cache(request)
            request.append_output_token(token)

    times: list[float] = []
    for _ in range(repeats):
        times += best_of(steps, step)
    best, median = min(times) * 1e3, statistics.median(times) * 1e3
    rows.add(f"decode step, {num_requests} requests", median, "ms", 1.0,
             higher_is_better=False, note=f"median of {len(times)} steps, best {best:.3f} ms; "
             f"every {BLOCK_SIZE}th step per request starts a block and hashes one")


def bench_prefill_step(rows: Rows, repeats: int) -> None:
    rng = random.Random(3)
    num_requests, prompt_len, shared = 32, 2000, 1500

    def prompt_set(prefix: list[int]) -> list[list[int]]:
        return [prefix + tokens(rng, prompt_len - shared) for _ in range(num_requests)]

    warm_prefix = tokens(rng, shared)
    # Warm: every step brings new suffixes after the same (cached) prefix. Cold: every
    # step brings a new prefix, so the 32 requests of a step compute it side by side.
    sets = {
        "warm": [prompt_set(warm_prefix) for _ in range(repeats + 1)],
        "cold": [prompt_set(tokens(rng, shared)) for _ in range(repeats + 1)],
    }
    for algorithm in ("sha256", "fast"):
        hasher = BlockHasher(BLOCK_SIZE, algorithm)
        for label, prompt_sets in sets.items():
            # Room for two steps' worth of blocks: older ones are evicted as in a server.
            manager = KVCacheManager(num_blocks=2 * num_requests * (prompt_len // BLOCK_SIZE + 1),
                                     block_size=BLOCK_SIZE)
            pending = iter(prompt_sets)
            counter = [0]

            def step(manager: KVCacheManager = manager, hasher: BlockHasher = hasher,
                     pending: Iterator[list[list[int]]] = pending,
                     counter: list[int] = counter) -> None:
                requests = []
                for prompt in next(pending):
                    counter[0] += 1
                    request = Request(f"q{counter[0]}", prompt, PARAMS, hasher)
                    hits, num = manager.find_cached_prefix(request)
                    if manager.allocate(request, request.num_tokens - num, hits) is None:
                        raise RuntimeError("pool too small for the benchmark")
                    request.num_computed_tokens = num
                    requests.append(request)
                for request in requests:  # the forward computed every prompt
                    request.num_computed_tokens = request.num_tokens
                    manager.cache_full_blocks(request)
                for request in requests:
                    manager.free(request)

            step()  # first step: warms the prefix (warm) / fills the pool (cold)
            before = manager.stats()
            t = best_of(repeats, step)
            after = manager.stats()
            hit_rate = (after.hits - before.hits) / (after.queries - before.queries)
            rows.add(f"prefill step {label}, {algorithm}", min(t) * 1e3, "ms",
                     note=f"32 x 2,000 tok, 1,500 shared; hit rate {hit_rate:.0%}, "
                     f"median {statistics.median(t) * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    total = 200_000 if args.quick else 1_000_000
    rows = Rows()
    print(f"pagellm core benchmarks: Python {platform.python_version()} on "
          f"{platform.machine()}, block_size {BLOCK_SIZE}\n")
    bench_hashing(rows, total, repeats)
    bench_lookup(rows, repeats)
    bench_alloc_free(rows, repeats)
    bench_decode_step(rows, 256, 50 if args.quick else 200, repeats)
    bench_prefill_step(rows, repeats)
    rows.print()
    if rows.missed:
        print(f"\nmissed targets: {', '.join(rows.missed)}")


if __name__ == "__main__":
    main()
