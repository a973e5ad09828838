"""Attention backends against a dense float64 reference that knows nothing of paging.

Each case draws requests with a cached context and new tokens (decodes, fresh prefills,
prefills over a prefix, all mixed), writes the context K/V straight into shuffled blocks,
and checks every backend's output, and the cache it leaves, against plain softmax
attention over each request's logical K/V history.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch
from paged_sim import build_metadata

from pagellm.cache_dir import resolve_cache_dir
from pagellm.model import attention, cpu_kernels
from pagellm.model.attention import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    AttentionSpec,
    GraphDecodePlan,
    TorchBatchedBackend,
    allocate_kv_caches,
    batched,
    get_attention_backend,
)

BACKENDS = sorted(ATTENTION_BACKENDS)
# The batched backend with the compiled CPU kernels (decode groups read the cache in place).
KERNELS = "torch_batched+cpu_kernels"


def kernels_loaded() -> bool:
    return cpu_kernels.load(resolve_cache_dir() / "kernels")


def prefix_attention(q: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix kernel on queries given kv head first, [Hkv, M, D]: one query head per kv
    head (group 1), laid out as the kernel reads them, [M, Hkv, D]."""
    result: tuple[torch.Tensor, torch.Tensor] = torch.ops.pagellm.paged_prefix_attention(
        q.transpose(0, 1).contiguous(), cache[0], cache[1], blocks, scale, 1)
    return result


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, window: int | None
) -> torch.Tensor:
    """q[Q, H, D] against k/v[L, Hkv, D], query i at position context + i, in float64."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    q_pos = torch.arange(q.shape[0])[:, None] + context
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_case(
    seed: int,
    shapes: list[tuple[int, int]],
    window: int | None = None,
    shared_blocks: int = 0,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> dict:
    """Requests given as (cached tokens, new tokens); everything else drawn from `seed`.

    With `shared_blocks`, every request starts with the same blocks holding the same K/V
    (a cached prefix they all hit), as the engine lays out a shared system prompt.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kv_heads, group, drawn_dim = rng.choice([(1, 4), (2, 2), (3, 3), (4, 1)]) + (
        rng.choice([8, 16]),
    )
    head_dim = head_dim or drawn_dim
    block_size = block_size or rng.choice([1, 2, 4, 16])
    needed = sum(-(-(c + q) // block_size) for c, q in shapes)
    num_blocks = needed + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    cache = allocate_kv_caches(
        1, (2, num_blocks, block_size, kv_heads, head_dim), torch.float32, "cpu"
    )[0]
    tables, histories, queries, new_k, new_v = [], [], [], [], []
    shared_len = shared_blocks * block_size
    # Even seeds lay the shared prefix in consecutive blocks (read in place by the cascade),
    # odd seeds scatter it (gathered).
    if seed % 2 == 0:
        shared_table = list(range(shared_blocks))
        free = [b for b in free if b >= shared_blocks]
    else:
        shared_table = [free.pop() for _ in range(shared_blocks)]
    shared_k = torch.randn(shared_len, kv_heads, head_dim, generator=gen)
    shared_v = torch.randn(shared_len, kv_heads, head_dim, generator=gen)
    for context, q_len in shapes:
        assert context >= shared_len, "a request must have computed the shared prefix"
        total = context + q_len
        table = shared_table + [
            free.pop() for _ in range(-(-total // block_size) - shared_blocks)
        ]
        k_hist = torch.cat([shared_k, torch.randn(total - shared_len, kv_heads, head_dim,
                                                  generator=gen)])
        v_hist = torch.cat([shared_v, torch.randn(total - shared_len, kv_heads, head_dim,
                                                  generator=gen)])
        for pos in range(context):  # the cached prefix, written by "earlier steps"
            block, offset = table[pos // block_size], pos % block_size
            cache[0, block, offset] = k_hist[pos]
            cache[1, block, offset] = v_hist[pos]
        tables.append(table)
        histories.append((k_hist, v_hist))
        queries.append(torch.randn(q_len, kv_heads * group, head_dim, generator=gen))
        new_k.append(k_hist[context:])
        new_v.append(v_hist[context:])
    # Stale, finite data in every free block, as a long-running pool would hold.
    for block in free:
        cache[:, block] = torch.randn(2, block_size, kv_heads, head_dim, generator=gen)
    meta = build_metadata(tables, [c for c, _ in shapes], [q for _, q in shapes], block_size)
    spec = AttentionSpec(kv_heads * group, kv_heads, head_dim, head_dim**-0.5, window)
    expected = torch.cat(
        [
            dense_attention(q, k, v, context, window)
            for q, (k, v), (context, _) in zip(queries, histories, shapes, strict=True)
        ]
    )
    return dict(
        cache=cache,
        meta=meta,
        spec=spec,
        query=torch.cat(queries),
        key=torch.cat(new_k),
        value=torch.cat(new_v),
        expected=expected,
        tables=tables,
        histories=histories,
        block_size=block_size,
    )


def run_backend(name: str, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    backend = get_attention_backend(name.removesuffix("+cpu_kernels"))
    backend.configure([case["spec"]])
    if name == KERNELS:
        if not kernels_loaded():
            pytest.skip("the CPU kernels cannot be built or run on this machine")
        backend.use_cpu_kernels()
    cache = case["cache"].clone()
    plan = backend.prepare(case["meta"])
    out = backend.forward(case["query"], case["key"], case["value"], cache, plan, case["spec"])
    return out, cache


def check(name: str, case: dict) -> None:
    out, cache = run_backend(name, case)
    assert out.shape == case["expected"].shape
    torch.testing.assert_close(out.double(), case["expected"], atol=2e-5, rtol=1e-5)
    check_cache(case, cache)


def check_cache(case: dict, cache: torch.Tensor) -> None:
    """Every request's whole K/V history sits in its slots."""
    bs = case["block_size"]
    for table, (k_hist, v_hist) in zip(case["tables"], case["histories"], strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(k_hist.shape[0])])
        flat = cache.view(2, -1, *cache.shape[-2:])
        assert torch.equal(flat[0, slots], k_hist)
        assert torch.equal(flat[1, slots], v_hist)


SCENARIOS = {
    "single_prefill": [(0, 13)],
    "single_decode": [(20, 1)],
    "decode_batch": [(5, 1), (17, 1), (1, 1), (33, 1)],
    "prefix_hit_prefill": [(16, 7)],
    "equal_prefills": [(0, 6), (0, 6), (8, 6)],
    "mixed": [(0, 9), (12, 1), (8, 9), (30, 1), (3, 2)],
    "long_and_short": [(0, 40), (64, 1), (2, 1)],
    "skewed_lengths": [(200, 1), (3, 1), (5, 2), (120, 1), (0, 30), (90, 3)],
}


@pytest.mark.parametrize("backend", [*BACKENDS, KERNELS])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("window", [None, 5])
def test_backend_matches_dense_reference(backend: str, scenario: str, window: int | None) -> None:
    head_dim = 64 if backend == KERNELS else None  # a size the kernel serves
    for seed in range(3):
        check(backend, make_case(seed, SCENARIOS[scenario], window, head_dim=head_dim))


@pytest.mark.parametrize("seed", range(12))
def test_backends_agree_on_random_batches(seed: int) -> None:
    rng = random.Random(1000 + seed)
    shapes = [
        (rng.choice([0, rng.randint(0, 40)]), rng.choice([1, 1, rng.randint(1, 20)]))
        for _ in range(rng.randint(1, 8))
    ]
    case = make_case(seed, shapes, rng.choice([None, None, rng.randint(1, 12)]))
    outputs = [run_backend(name, case) for name in BACKENDS]
    for out, cache in outputs[1:]:
        torch.testing.assert_close(out, outputs[0][0], atol=2e-5, rtol=1e-5)
        assert torch.equal(cache, outputs[0][1])
    check(BACKENDS[0], case)


GRAPH_DECODE_SCENARIOS = {
    "single": [(20, 1)],
    "batch": [(5, 1), (17, 1), (1, 1), (33, 1)],
    # A one-token prompt (no context) and a fully cached prompt's last token are steps of
    # one query per request too, and take the same path.
    "skewed": [(200, 1), (3, 1), (120, 1), (0, 1)],
}


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu_kernels"])
@pytest.mark.parametrize("scenario", sorted(GRAPH_DECODE_SCENARIOS))
@pytest.mark.parametrize("window", [None, 5])
def test_graph_decode_plan_matches_dense_reference(kernels: bool, scenario: str,
                                                   window: int | None) -> None:
    """The fixed-shape decode of a CUDA graph (tables wider than any request needs, their
    extra columns pointing at blocks of stale data), run eagerly: the same attention."""
    for seed in range(3):
        case = make_case(seed, GRAPH_DECODE_SCENARIOS[scenario], window,
                         head_dim=64 if kernels else None)
        meta = case["meta"]
        rows = meta.block_tables.shape[0]
        stale = torch.randint(0, case["cache"].shape[1], (rows, 3), dtype=torch.int32,
                              generator=torch.Generator().manual_seed(seed))
        wide = dataclasses.replace(meta, block_tables=torch.cat([meta.block_tables, stale], 1))
        backend = TorchBatchedBackend()
        backend.configure([case["spec"]])
        if kernels:
            if not kernels_loaded():
                pytest.skip("the CPU kernels cannot be built or run on this machine")
            backend.use_cpu_kernels()
        cache = case["cache"].clone()
        out = backend.forward(case["query"], case["key"], case["value"], cache,
                              GraphDecodePlan(wide), case["spec"])
        torch.testing.assert_close(out.double(), case["expected"], atol=2e-5, rtol=1e-5)
        check_cache(case, cache)


def test_graph_decode_plan_builds_each_mask_once() -> None:
    case = make_case(0, GRAPH_DECODE_SCENARIOS["batch"], None)
    plan = GraphDecodePlan(case["meta"])
    first = plan.additive_mask(None, torch.float32)
    assert plan.additive_mask(None, torch.float32) is first
    assert plan.additive_mask(4, torch.float32) is not first
    seq_lens = case["meta"].seq_lens.tolist()
    visible = (first[:, 0, 0] == 0).sum(dim=1).tolist()
    assert visible == seq_lens


SHARED_PREFIX_SCENARIOS = {
    "decodes": [(40, 1), (45, 1), (33, 1), (64, 1)],
    "prefills": [(32, 5), (40, 9), (36, 1), (50, 3)],
    "exactly_the_prefix": [(32, 1), (32, 1), (32, 7)],
}


@pytest.mark.parametrize("backend", [*BACKENDS, KERNELS])
@pytest.mark.parametrize("scenario", sorted(SHARED_PREFIX_SCENARIOS))
@pytest.mark.parametrize("window", [None, 5])
def test_shared_prefix_batches_match_dense_reference(
    backend: str, scenario: str, window: int | None
) -> None:
    """Requests whose block tables begin with the same blocks (the cascade path of the
    batched backend attends that prefix once for all of them)."""
    head_dim = 64 if backend == KERNELS else None
    for seed in range(3):
        case = make_case(seed, SHARED_PREFIX_SCENARIOS[scenario], window, shared_blocks=8,
                         block_size=4, head_dim=head_dim)
        check(backend, case)


@pytest.mark.parametrize("shared_blocks", [0, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_kernel_is_taken_and_exact(
    monkeypatch: pytest.MonkeyPatch, shared_blocks: int, head_dim: int
) -> None:
    """Decode groups go through the paged kernel (alone, or after a cascade's shared
    prefix), and agree with the dense float64 reference; blocks of 16 and of 64. The
    cascade is forced here; a small group keeps to the decode kernel alone."""
    calls: list[str] = []
    decode = TorchBatchedBackend._decode_with_kernel
    prefix = TorchBatchedBackend._decode_prefix

    def counting_decode(*args: Any) -> Any:
        calls.append("decode")
        return decode(*args)

    def counting_prefix(*args: Any) -> Any:
        calls.append("prefix")
        return prefix(*args)

    monkeypatch.setattr(TorchBatchedBackend, "_decode_with_kernel", counting_decode)
    monkeypatch.setattr(TorchBatchedBackend, "_decode_prefix", counting_prefix)
    check(KERNELS, make_case(3, [(40, 1), (41, 1)], shared_blocks=8, block_size=4,
                             head_dim=head_dim))
    assert calls == ["decode"]
    monkeypatch.setattr(batched, "MIN_DECODE_CASCADE_KEYS", 1)
    for seed, block_size in ((0, 16), (1, 64), (2, 4)):
        shapes = [(max(shared_blocks * block_size, c), 1) for c in (5, 40, 130, 71)]
        calls.clear()
        check(KERNELS, make_case(seed, shapes, shared_blocks=shared_blocks,
                                 block_size=block_size, head_dim=head_dim))
        assert "decode" in calls
        # A shared prefix is attended once for all requests (the cascade), then merged.
        assert ("prefix" in calls) == (shared_blocks > 0)


def test_small_shared_decode_groups_join_the_decode_call() -> None:
    """Decodes sharing a prefix too short to cascade go in the one decode-kernel group
    with the others (in batch order); a group large enough keeps its own cascade."""
    backend = get_attention_backend("torch_batched")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125)
    backend.configure([spec])
    backend.use_cpu_kernels()  # only the plan is built: no kernel runs
    shared = list(range(8))
    tables = [shared + [20], [30, 31, 32, 33, 34, 35, 36, 37, 38], shared + [21]]
    meta = build_metadata(tables, [140, 140, 140], [1, 1, 1], block_size=16)
    plan = backend.prepare(meta)
    assert len(plan.groups) == 1 and plan.groups[0].prefix_blocks is None
    assert plan.groups[0].out_dst is None  # the whole batch, in order
    many = [shared + [40 + r] for r in range(20)]
    meta = build_metadata([*many, tables[1]], [140] * 21, [1] * 21, block_size=16)
    groups = backend.prepare(meta).groups
    assert sorted(g.n_requests for g in groups) == [1, 20]
    assert [g.prefix_blocks is not None for g in groups if g.n_requests == 20] == [True]


def test_decode_kernel_rejects_bad_inputs() -> None:
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    cache = torch.zeros(2, 4, 16, 2, 64)
    q = torch.randn(1, 4, 64)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    attend = torch.ops.pagellm.paged_decode_attention
    with pytest.raises(RuntimeError, match="keys for 2 blocks"):
        attend(q, cache[0], cache[1], tables, torch.tensor([33], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="not supported"):
        attend(torch.randn(1, 4, 48), torch.zeros(4, 16, 2, 48), torch.zeros(4, 16, 2, 48),
               tables, torch.tensor([3], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        attend(torch.randn(1, 64, 4).transpose(1, 2), cache[0], cache[1], tables,
               torch.tensor([3], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_kernel_merges_a_prior_attention_exactly(head_dim: int) -> None:
    """The prefix kernel over some blocks, then the decode kernel over others with that
    result as its prior, equals attention over all the keys (float64 reference), for
    prefixes up to a score scale where the prior dominates or vanishes."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    gen = torch.Generator().manual_seed(3)
    requests, heads, kv_heads, block_size = 5, 6, 2, 4
    group = heads // kv_heads
    cache = torch.randn(2, 24, block_size, kv_heads, head_dim, generator=gen)
    prefix = torch.tensor([7, 3, 11], dtype=torch.int32)
    own = torch.tensor([[0, 1], [2, 4], [5, 6], [8, 9], [10, 12]], dtype=torch.int32)
    own_lens = torch.tensor([1, 3, 4, 6, 8], dtype=torch.int32)
    for scale in (0.125, 2.0):
        q = torch.randn(requests, heads, head_dim, generator=gen)
        prior = torch.ops.pagellm.paged_prefix_attention(q, cache[0], cache[1], prefix, scale,
                                                         group)
        # The same queries read in place, a strided view as of the qkv output: same bits.
        wide = torch.randn(requests, heads + 4, head_dim, generator=gen)
        wide[:, 1 : 1 + heads] = q
        in_place = torch.ops.pagellm.paged_prefix_attention(
            wide[:, 1 : 1 + heads], cache[0], cache[1], prefix, scale, group)
        assert all(torch.equal(a, b) for a, b in zip(in_place, prior, strict=True))
        out, lse = torch.ops.pagellm.paged_decode_attention(
            q, cache[0], cache[1], own, own_lens, scale, *prior)
        for r in range(requests):
            blocks = torch.cat([prefix, own[r]]).long()
            n_keys = len(prefix) * block_size + int(own_lens[r])
            k, v = (cache[i][blocks].reshape(-1, kv_heads, head_dim)[:n_keys].double()
                    for i in range(2))
            k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
            scores = q[r].double()[:, None, :] @ k.transpose(1, 2) * scale
            expected = torch.softmax(scores, dim=-1) @ v
            torch.testing.assert_close(out[r].double(), expected[:, 0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[r].double(), torch.logsumexp(scores, -1)[:, 0],
                                       atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="whole groups of query heads"):
        torch.ops.pagellm.paged_prefix_attention(q, cache[0], cache[1], prefix, 0.1, 4)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        torch.ops.pagellm.paged_prefix_attention(q.transpose(1, 2), cache[0], cache[1], prefix,
                                                 0.1, group)
    with pytest.raises(RuntimeError, match="whole groups of query heads"):
        torch.ops.pagellm.paged_prefix_attention(q, cache[0], cache[1], prefix, 0.1, 0)
    with pytest.raises(RuntimeError, match="go together"):
        torch.ops.pagellm.paged_decode_attention(q, cache[0], cache[1], own, own_lens, 0.1,
                                                 prior[0], None)
    with pytest.raises(RuntimeError, match="prior_out must be"):
        torch.ops.pagellm.paged_decode_attention(q, cache[0], cache[1], own, own_lens, 0.1,
                                                 prior[0][:1], prior[1])


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 2), (10, 2), (16, 2), (40, 40)])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("many", [False, True])
def test_decode_kernel_matches_float64_for_any_head_grouping(
        heads: int, kv_heads: int, block_size: int, many: bool) -> None:
    """Every query-head group (1 to 8 heads a kv head, in tiles of 3 heads with AVX2 and a
    remainder), ragged last blocks, with and without a prior; `many` gives enough requests
    that a task takes several of a request's kv heads at once (AVX2; 40 kv heads of 1 go in
    runs of 32 and 8)."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    gen = torch.Generator().manual_seed(heads * block_size)
    group, dim = heads // kv_heads, 64
    requests = 4 * torch.get_num_threads() + 1 if many else 2
    cache = torch.randn(2, 6 * requests, block_size, kv_heads, dim, generator=gen)
    tables = torch.randperm(6 * requests, generator=gen).to(torch.int32).view(requests, 6)
    lens = torch.randint(1, 6 * block_size + 1, (requests,), generator=gen, dtype=torch.int32)
    q = torch.randn(requests, heads, dim, generator=gen)
    prior_out = torch.randn(kv_heads, requests * group, dim, generator=gen)
    prior_lse = torch.randn(kv_heads, requests * group, generator=gen)
    plain = torch.ops.pagellm.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.125)
    merged = torch.ops.pagellm.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.125,
                                                      prior_out, prior_lse)
    # Queries read in place from wider rows (a view of the qkv output): the same bits.
    wide = torch.randn(requests, (heads + 2 * kv_heads) * dim, generator=gen)
    wide[:, :heads * dim] = q.flatten(1)
    strided = wide[:, :heads * dim].view(requests, heads, dim)
    assert not strided.is_contiguous()
    for got, want in zip(torch.ops.pagellm.paged_decode_attention(
            strided, cache[0], cache[1], tables, lens, 0.125, prior_out, prior_lse), merged,
            strict=True):
        assert torch.equal(got, want)
    for r in range(requests):
        n = int(lens[r])
        k, v = (cache[i][tables[r].long()].reshape(-1, kv_heads, dim)[:n].double()
                for i in range(2))
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        scores = (q[r].double()[:, None, :] @ k.transpose(1, 2) * 0.125)[:, 0]
        out = (torch.softmax(scores, dim=-1)[:, None, :] @ v)[:, 0]
        lse = torch.logsumexp(scores, -1)
        torch.testing.assert_close(plain[0][r].double(), out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(plain[1][r].double(), lse, atol=1e-5, rtol=1e-5)
        head = torch.arange(heads)  # its prior row: kv head-major, then request, then head
        rows = head // group * requests * group + r * group + head % group
        p_out, p_lse = prior_out.view(-1, dim)[rows].double(), prior_lse.view(-1)[rows].double()
        total = torch.logaddexp(lse, p_lse)
        expected = out * (lse - total).exp()[:, None] + p_out * (p_lse - total).exp()[:, None]
        torch.testing.assert_close(merged[0][r].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged[1][r].double(), total, atol=1e-5, rtol=1e-5)


def test_shared_prefix_takes_the_cascade_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared-prefix scenarios above really exercise the cascade (not a silent fallback)."""
    calls = []
    original = TorchBatchedBackend._attend_cascade

    def counting(self: TorchBatchedBackend, *args: object) -> torch.Tensor:
        calls.append(1)
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(TorchBatchedBackend, "_attend_cascade", counting)
    case = make_case(0, [(40, 1), (41, 1), (42, 1)], shared_blocks=8, block_size=4)
    check("torch_batched", case)
    assert calls


def test_batched_backend_plan_is_reused_across_layers() -> None:
    """One plan serves every layer; a second forward with it must give the same result."""
    case = make_case(7, SCENARIOS["mixed"])
    backend = get_attention_backend("torch_batched")
    plan = backend.prepare(case["meta"])
    cache = case["cache"].clone()
    args = (case["query"], case["key"], case["value"], cache, plan, case["spec"])
    first = backend.forward(*args)
    second = backend.forward(*args)
    assert torch.equal(first, second)


def test_default_backend_is_known() -> None:
    assert DEFAULT_ATTENTION_BACKEND in ATTENTION_BACKENDS
    assert get_attention_backend(None).name == DEFAULT_ATTENTION_BACKEND


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match="torch_batched"):
        get_attention_backend("flash_nonexistent")


def test_prompt_chunks_take_one_prefill_kernel_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels, every prompt chunk of a step, alone or several, fresh or after
    its context, sharing a prefix or not, beside decodes or not, is attended by one call
    of the prefill kernel per layer, and the result is the reference's."""
    calls: list[int] = []
    prefill = TorchBatchedBackend._prefill_with_kernel

    def counting(self: TorchBatchedBackend, *args: Any) -> Any:
        calls.append(int(args[2].lens.numel()))
        return prefill(self, *args)

    monkeypatch.setattr(TorchBatchedBackend, "_prefill_with_kernel", counting)
    cases = [
        ([(0, 70)], 4, 0, 1),
        ([(40, 9)], 16, 0, 1),
        ([(37, 12), (0, 5), (20, 1)], 1, 0, 2),  # two chunks beside a decode
        ([(130, 66)], 64, 0, 1),
        ([(32, 5), (44, 3)], 4, 8, 2),  # sharing a prefix: no cascade
        ([(32, 5), (40, 1), (44, 3), (33, 1)], 4, 8, 2),
    ]
    for seed, (shapes, block_size, shared, chunks) in enumerate(cases):
        calls.clear()
        check(KERNELS, make_case(seed, shapes, block_size=block_size, head_dim=64,
                                 shared_blocks=shared))
        assert calls and set(calls) == {chunks}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [5, 16])
def test_prefix_kernel_over_many_key_chunks_is_exact(head_dim: int, block_size: int) -> None:
    """The prefix kernel walks its keys block by block in chunks; across chunk and block
    boundaries, in chunks every row sees whole and in chunks cut by the causal limits, and
    with scores that grow along the keys (so the running maximum moves every chunk), it
    agrees with float64 attention, log-sum-exp included."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    gen = torch.Generator().manual_seed(11)
    kv_heads, group, n_blocks = 2, 3, 31
    cache = torch.randn(2, 40, block_size, kv_heads, head_dim, generator=gen)
    blocks = torch.randperm(40, generator=gen)[:n_blocks].to(torch.int32)
    n_keys = n_blocks * block_size
    # Later keys (in the table's order) point more and more along the queries' shared
    # direction, so the scores' maximum moves on with every chunk.
    ramp = torch.linspace(0.0, 3.0, n_keys).view(n_blocks, block_size, 1, 1)
    cache[0][blocks.long()] += ramp * torch.ones(head_dim) / head_dim**0.5
    k, v = (cache[i][blocks.long()].reshape(n_keys, kv_heads, head_dim).double()
            for i in range(2))
    for rows, context in ((1, -1), (40, -1), (100, -1), (9, 90), (150, n_keys - 50), (48, 0)):
        q = torch.randn(kv_heads, rows, head_dim, generator=gen) + 1.0
        if context < 0:
            out, lse = prefix_attention(q, cache, blocks, 0.5)
        else:
            # A causal chunk is read and written as the model lays out queries, [Q, H, D],
            # here a strided view of a wider tensor (as of the fused qkv output).
            wide = torch.randn(rows // group, kv_heads * group + 5, head_dim, generator=gen)
            model_q = wide[:, 2 : 2 + kv_heads * group]
            model_q.copy_(q.view(kv_heads, rows // group, group, head_dim).transpose(0, 1)
                          .reshape(rows // group, kv_heads * group, head_dim))
            model_out, lse = torch.ops.pagellm.paged_prefill_attention(
                model_q, cache[0], cache[1], blocks[None], torch.tensor([0]),
                torch.tensor([rows // group]), torch.tensor([context]), 0.5, group)
            assert model_out.shape == model_q.shape
            out = (model_out.view(rows // group, kv_heads, group, head_dim).transpose(0, 1)
                   .reshape(kv_heads, rows, head_dim))
        scores = torch.einsum("hmd,khd->hmk", q.double(), k) * 0.5
        if context >= 0:
            limits = context + torch.arange(rows) // group + 1
            scores = scores.masked_fill(torch.arange(n_keys) >= limits[:, None], float("-inf"))
        expected = torch.einsum("hmk,khd->hmd", scores.softmax(-1), v)
        # float32 sums over up to 496 keys land a few 1e-5 from float64.
        torch.testing.assert_close(out.double(), expected, atol=5e-5, rtol=1e-4)
        torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_prefill_kernel_attends_every_chunk_causally(head_dim: int, block_size: int) -> None:
    """One call for every prompt chunk of a step: requests with and without context, of
    one query to several row tiles, their queries at scattered rows of a strided [T, H, D]
    view (as of the fused qkv output), each against its own table; float64 reference,
    log-sum-exp included, and the same bits on one thread as on several."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    gen = torch.Generator().manual_seed(block_size * 1000 + head_dim)
    kv_heads, group, width = 2, 3, 24
    cache = torch.randn(2, 400, block_size, kv_heads, head_dim, generator=gen)
    cases = [(0, 1), (0, 70), (33, 1), (40, 9), (130, 66), (7, 30)]  # (context, queries)
    pool = torch.randperm(400, generator=gen).to(torch.int32)
    tables = torch.zeros(len(cases), width * 16 // block_size + 1, dtype=torch.int32)
    used = 0
    for r, (context, n) in enumerate(cases):
        need = -(-(context + n) // block_size)
        tables[r, :need] = pool[used : used + need]
        used += need
    # Rows of the batch: decodes and padding between the chunks, which must stay unread.
    starts = torch.tensor([3, 5, 80, 90, 101, 170])
    lens = torch.tensor([n for _, n in cases])
    contexts = torch.tensor([c for c, _ in cases])
    wide = torch.randn(200, kv_heads * group + 4, head_dim, generator=gen)
    q = wide[:, 1 : 1 + kv_heads * group]
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            results.append(torch.ops.pagellm.paged_prefill_attention(
                q, cache[0], cache[1], tables, starts, lens, contexts, 0.3, group))
    finally:
        torch.set_num_threads(threads)
    for out_other, lse_other in results[1:]:
        assert torch.equal(out_other, results[0][0]) and torch.equal(lse_other, results[0][1])
    out, lse = results[0]
    assert out.shape == (int(lens.sum()), kv_heads * group, head_dim)
    first = 0
    for r, (context, n) in enumerate(cases):
        blocks = tables[r, : -(-(context + n) // block_size)].long()
        k, v = (cache[i][blocks].flatten(0, 1)[: context + n].double() for i in range(2))
        rows = q[starts[r] : starts[r] + n].double().view(n, kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hqgk", rows, k) * 0.3
        visible = torch.arange(context + n) <= context + torch.arange(n)[:, None]
        scores = scores.masked_fill(~visible[None, :, None], float("-inf"))
        expected = torch.einsum("hqgk,khd->qhgd", scores.softmax(-1), v)
        got = out[first : first + n].view(n, kv_heads, group, head_dim).double()
        torch.testing.assert_close(got, expected, atol=5e-5, rtol=1e-4)
        own_lse = lse[:, first * group : (first + n) * group].view(kv_heads, n, group)
        torch.testing.assert_close(own_lse.double(), torch.logsumexp(scores, -1),
                                   atol=1e-5, rtol=1e-5)
        first += n


def test_prefill_kernel_rejects_bad_inputs() -> None:
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    cache = torch.zeros(2, 4, 16, 2, 64)
    tables = torch.zeros(1, 2, dtype=torch.int32)

    def call(q: torch.Tensor, starts: list[int], lens: list[int], contexts: list[int],
             group: int = 2) -> None:
        torch.ops.pagellm.paged_prefill_attention(
            q, cache[0], cache[1], tables, torch.tensor(starts), torch.tensor(lens),
            torch.tensor(contexts), 0.125, group)

    with pytest.raises(RuntimeError, match="whole groups"):
        call(torch.randn(4, 5, 64), [0], [2], [0])
    with pytest.raises(RuntimeError, match="contiguous heads"):
        call(torch.randn(4, 4, 64).transpose(0, 1), [0], [2], [0])
    with pytest.raises(RuntimeError, match="out of range"):
        call(torch.randn(4, 4, 64), [3], [2], [0])  # queries past the batch
    with pytest.raises(RuntimeError, match="out of range"):
        call(torch.randn(4, 4, 64), [0], [4], [30])  # keys past the table
    with pytest.raises(RuntimeError, match="out of range"):
        call(torch.randn(4, 4, 64), [0], [0], [0])  # an empty chunk
    tables[0, 1] = 4  # the cache has blocks 0-3
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(torch.randn(4, 4, 64), [0], [2], [20])  # reads block 1 of the table
    call(torch.randn(4, 4, 64), [0], [2], [10])  # block 0 only: fine


def test_prefix_kernel_results_do_not_depend_on_the_threads() -> None:
    """Threads take the (kv head, row tile) tasks as they free up, so which thread computes
    a tile changes from call to call; every tile is computed alone, so the result is the
    same bits on one thread as on several, causal and not."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 80, 16, 3, 64, generator=gen)
    blocks = torch.randperm(80, generator=gen)[:70].to(torch.int32)
    causal_q = torch.randn(300, 9, 64, generator=gen)  # 900 rows a head: 15 tiles
    shared_q = torch.randn(3, 200, 64, generator=gen)
    few_q = torch.randn(3, 6, 64, generator=gen)  # 3 tasks: its keys are split too
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append((
                torch.ops.pagellm.paged_prefill_attention(
                    causal_q, cache[0], cache[1], blocks[None], torch.tensor([0]),
                    torch.tensor([300]), torch.tensor([70 * 16 - 300]), 0.125, 3),
                prefix_attention(shared_q, cache, blocks, 0.125),
                prefix_attention(few_q, cache, blocks, 0.125)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for (out, lse), (out_ref, lse_ref) in zip(other, results[0], strict=True):
            assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)


@pytest.mark.parametrize("n_blocks", [1, 2, 3, 7])
@pytest.mark.parametrize("rows", [1, 6, 64, 65])
def test_prefix_kernel_splits_the_keys_of_a_small_cascade_exactly(
    n_blocks: int, rows: int
) -> None:
    """A cascade with fewer (kv head, row tile) tasks than the kernel wants splits its keys
    into up to 4 parts at block boundaries (never more parts than blocks) and merges them
    through their log-sum-exp; the result is attention over all the keys (float64
    reference), for one kv head (4 parts), three (2 parts) and rows in one or two tiles,
    with scores steep enough that one part holds almost all of a row's mass."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    gen = torch.Generator().manual_seed(rows * 10 + n_blocks)
    for kv_heads in (1, 3):
        cache = torch.randn(2, 12, 16, kv_heads, 64, generator=gen)
        blocks = torch.randperm(12, generator=gen)[:n_blocks].to(torch.int32)
        q = torch.randn(kv_heads, rows, 64, generator=gen) * 2.0
        cache[0][blocks[-1].long(), :3] += 2.0 * q.mean(1)[None].sign()
        out, lse = prefix_attention(q, cache, blocks, 0.3)
        k, v = (cache[i][blocks.long()].reshape(-1, kv_heads, 64).double() for i in range(2))
        scores = torch.einsum("hmd,khd->hmk", q.double(), k) * 0.3
        expected = torch.einsum("hmk,khd->hmd", scores.softmax(-1), v)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=2e-5,
                                   rtol=1e-5)


def test_kv_write_kernel_stores_strided_rows_like_index_copy() -> None:
    """The compiled K/V store takes the k and v column ranges of a fused qkv output as they
    are (strided rows) and leaves the cache as the torch path does; a slot outside the
    cache is refused before anything is written."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 3, 200):
        qkv = torch.randn(tokens, (4 + 2 + 2) * 16, generator=gen)
        _, k, v = qkv.split([64, 32, 32], dim=-1)
        k, v = k.view(tokens, 2, 16), v.view(tokens, 2, 16)
        slots = torch.randperm(40 * 8, generator=gen)[:tokens]
        expected = torch.randn(2, 40, 8, 2, 16, generator=gen)
        got = expected.clone()
        attention.write_kv_cache(expected, k, v, slots)
        torch.ops.pagellm.write_kv_cache_(got, k, v, slots)
        assert torch.equal(got, expected)
    before = got.clone()
    with pytest.raises(RuntimeError, match="outside the cache's 320 slots"):
        torch.ops.pagellm.write_kv_cache_(got, k[:2], v[:2], torch.tensor([3, 320]))
    with pytest.raises(RuntimeError, match="one per slot"):
        torch.ops.pagellm.write_kv_cache_(got, k[:2], v[:1], torch.tensor([3, 4]))
    assert torch.equal(got, before)


# A bfloat16 pool (kv_cache_dtype="bfloat16"): keys and values are rounded once, where
# they are stored, and read back exactly.
def rounded_to_bf16(case: dict) -> dict:
    """The case as a float32 pool holding what a bfloat16 pool would hold."""
    return dict(case, cache=case["cache"].bfloat16().float(),
                key=case["key"].bfloat16().float(), value=case["value"].bfloat16().float())


@pytest.mark.parametrize("backend", [*BACKENDS, KERNELS])
@pytest.mark.parametrize("scenario", [*sorted(SCENARIOS), *sorted(SHARED_PREFIX_SCENARIOS)])
def test_bfloat16_pool_reads_as_the_float32_values_it_holds(backend: str, scenario: str) -> None:
    """Every backend (torch's gathers and cascades; the decode and prefill kernels, whose
    cascade these few shared keys do not reach: see the next test) gives over a bfloat16
    pool, bit for bit, what it gives over a float32 pool holding the same rounded values;
    the step's new rows are stored rounded as torch rounds them."""
    head_dim = 64 if backend == KERNELS else None
    shared = scenario in SHARED_PREFIX_SCENARIOS
    shapes = SHARED_PREFIX_SCENARIOS[scenario] if shared else SCENARIOS[scenario]
    for seed in range(3):
        case = make_case(seed, shapes, shared_blocks=8 if shared else 0,
                         block_size=4 if shared else None, head_dim=head_dim)
        want_out, want_cache = run_backend(backend, rounded_to_bf16(case))
        out, cache = run_backend(backend, dict(case, cache=case["cache"].bfloat16()))
        assert cache.dtype == torch.bfloat16
        assert torch.equal(cache.float(), want_cache)
        assert torch.equal(out, want_out)
        # Three significant digits of keys and values move the outputs by about as much.
        torch.testing.assert_close(out.double(), case["expected"], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bfloat16_decode_over_long_contexts_matches_float32(head_dim: int) -> None:
    """Many blocks and key chunks (the prefix kernel widens a chunk of 48 keys at a
    time, its last chunk partial), with and without a forced cascade, through the kernels
    against the same kernels over the rounded float32 pool."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    shapes = [(150, 1), (171, 1), (133, 1), (149, 2)]
    prefix = TorchBatchedBackend._decode_prefix
    calls: list[torch.dtype] = []

    def counting_prefix(self: TorchBatchedBackend, q: torch.Tensor, kv: torch.Tensor,
                        *args: Any) -> Any:
        calls.append(kv.dtype)
        return prefix(self, q, kv, *args)

    for shared_blocks in (0, 8):
        case = make_case(3, shapes, shared_blocks=shared_blocks, block_size=16,
                         head_dim=head_dim)
        calls.clear()

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(batched, "MIN_DECODE_CASCADE_KEYS", 1)
            patch.setattr(TorchBatchedBackend, "_decode_prefix", counting_prefix)
            want_out, _ = run_backend(KERNELS, rounded_to_bf16(case))
            out, _ = run_backend(KERNELS, dict(case, cache=case["cache"].bfloat16()))
        assert torch.equal(out, want_out)
        # The cascade's prefix kernel ran over both pools exactly when a prefix is shared.
        assert calls == ([torch.float32, torch.bfloat16] if shared_blocks else [])


def test_kv_write_kernel_rounds_to_bfloat16_as_torch_does() -> None:
    """The compiled store into a bfloat16 pool rounds every float as torch's `.bfloat16()`
    does: ties to even, both signs, infinities, NaN kept a NaN, values past bfloat16's
    range to infinity, subnormals, zeros of both signs."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    gen = torch.Generator().manual_seed(9)
    bits = torch.randint(-2**31, 2**31, (600, 2, 64), generator=gen, dtype=torch.int64)
    # Low halves at and around the tie (0x8000), on even and odd upper halves.
    bits[:100] = (bits[:100] & ~0xFFFF) | torch.tensor([0x7FFF, 0x8000, 0x8001, 0])[
        torch.randint(0, 4, (100, 2, 64), generator=gen)]
    rows = bits.to(torch.int32).view(torch.float32)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                            -1e-40, 3.4e38, -3.4e38, 3.3961e38, 1.0, -1.0, 65504.0, 1e-45,
                            float(torch.finfo(torch.float32).max), 2.0**-133])
    rows[100, 0, :16] = special
    rows[101, 1, 16:32] = special
    key, value = rows, rows.roll(1, 0)
    slots = torch.randperm(80 * 8, generator=gen)[:600]
    expected = torch.zeros(2, 80, 8, 2, 64, dtype=torch.bfloat16)
    got = expected.clone()
    attention.write_kv_cache(expected, key, value, slots)
    torch.ops.pagellm.write_kv_cache_(got, key, value, slots)
    # A NaN's payload differs between torch's own scalar and vector conversions.
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])
    assert nan.sum() > 0 and expected.isinf().sum() > 0


def test_attention_kernels_refuse_mixed_or_unkept_pool_dtypes() -> None:
    """A pool whose K and V differ in dtype, or of a dtype the kernels do not read, is
    refused with the op's message, not read as the wrong bytes."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    q = torch.randn(2, 4, 64)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    k = torch.zeros(3, 16, 2, 64)
    for k_cache, v_cache in ((k, k.bfloat16()), (k.half(), k.half())):
        with pytest.raises(RuntimeError, match="float32 or bfloat16 .* both alike"):
            torch.ops.pagellm.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1)
        with pytest.raises(RuntimeError, match="float32 or bfloat16 .* both alike"):
            torch.ops.pagellm.paged_prefix_attention(q, k_cache, v_cache,
                                                     torch.zeros(1, dtype=torch.int32), 0.1, 2)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.pagellm.write_kv_cache_(torch.zeros(2, 3, 16, 2, 64, dtype=torch.float16),
                                          q[:, :2], q[:, 2:], torch.tensor([0, 1]))


def bf16_products_or_skip(wanted: bool) -> None:
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    if wanted and not torch.ops.pagellm.bf16_products_available():
        pytest.skip("this build of the kernels has no bfloat16 products (AVX-512 BF16)")


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 48])
def test_prefill_kernel_goes_on_from_a_prefix_state_bit_for_bit(
        kv_dtype: torch.dtype, head_dim: int, block_size: int, bf16: bool) -> None:
    """paged_prefix_state over a shared prefix of P keys (P a multiple of the 48-key
    chunk), then paged_prefill_attention from that state over each request's own keys,
    gives the very bits of one prefill call over all the keys, for decodes (one query)
    and chunks of several queries, each request alone or in a batch: what row-invariant
    attention's cascade relies on; with float32 or bfloat16 products."""
    bf16_products_or_skip(bf16)
    gen = torch.Generator().manual_seed(block_size + head_dim)
    kv_heads, group = 3, 3
    cache = torch.randn(2, 300, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    for prior_keys in (48, 144):
        shared = torch.randperm(300, generator=gen)[: prior_keys // block_size].to(torch.int32)
        cases = [(prior_keys + 5, 1), (prior_keys, 1), (prior_keys + 100, 1), (prior_keys + 7, 20)]
        width = -(-(prior_keys + 130) // block_size)
        tables = torch.zeros(len(cases), width, dtype=torch.int32)
        for r, (context, n) in enumerate(cases):
            need = -(-(context + n) // block_size)
            own = torch.randperm(300, generator=gen)[: need - len(shared)]
            tables[r, :need] = torch.cat([shared, own.to(torch.int32)])
        lens = torch.tensor([n for _, n in cases])
        starts = torch.cumsum(lens, 0) - lens
        contexts = torch.tensor([c for c, _ in cases])
        q = torch.randn(int(lens.sum()), kv_heads * group, head_dim, generator=gen)
        one_pass = torch.ops.pagellm.paged_prefill_attention(
            q, cache[0], cache[1], tables, starts, lens, contexts, 0.2, group, None, 0, bf16)[0]
        state = torch.ops.pagellm.paged_prefix_state(q, cache[0], cache[1], shared, 0.2, group,
                                                     bf16)
        assert state.shape == (kv_heads, int(lens.sum()) * group, head_dim + 2)
        resumed = torch.ops.pagellm.paged_prefill_attention(
            q, cache[0], cache[1], tables, starts, lens, contexts, 0.2, group, state, prior_keys,
            bf16)[0]
        assert torch.equal(resumed, one_pass)
        # A decode's state taken alone (a tile of its 3 rows: keys in the lanes) is its
        # rows of the batch's state.
        first_decode = int(starts[2])
        alone_state = torch.ops.pagellm.paged_prefix_state(
            q[first_decode : first_decode + 1], cache[0], cache[1], shared, 0.2, group, bf16)
        assert torch.equal(alone_state,
                           state[:, first_decode * group : (first_decode + 1) * group])
        # A request alone (in a call of its own) gives the same bits as in the batch.
        alone = torch.ops.pagellm.paged_prefill_attention(
            q[2:3], cache[0], cache[1], tables[2:3], torch.tensor([0]), lens[2:3],
            contexts[2:3], 0.2, group, None, 0, bf16)[0]
        assert torch.equal(alone, one_pass[2:3])
        if bf16:  # not the float32 kernel's bits, but close to them
            floats = torch.ops.pagellm.paged_prefill_attention(
                q, cache[0], cache[1], tables, starts, lens, contexts, 0.2, group)[0]
            assert not torch.equal(floats, one_pass)
            torch.testing.assert_close(one_pass, floats, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [5, 16])
def test_bf16_products_are_attention_over_bfloat16_inputs(
        kv_dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    """With bf16_products, the prefill kernel (causal chunks of one query to several
    row tiles, after a context or none, keys past several 48-key chunks, odd counts of
    keys in a chunk) is float64 attention over the scaled queries, keys and values
    rounded to bfloat16, within the rounding of the probabilities to bfloat16; the
    log-sum-exp too. (The prefix state it goes on from is checked against this kernel's
    one pass, bit for bit, above.)"""
    bf16_products_or_skip(True)
    gen = torch.Generator().manual_seed(head_dim + block_size)
    kv_heads, group, scale = 2, 3, 0.3
    cache = torch.randn(2, 200, block_size, kv_heads, head_dim, generator=gen)
    cases = [(0, 1), (0, 49), (95, 1), (300, 70), (7, 23)]  # (context, queries)
    width = -(-max(c + n for c, n in cases) // block_size)
    tables = torch.zeros(len(cases), width, dtype=torch.int32)
    pool = torch.randperm(200, generator=gen).int()
    used = 0
    for r, (context, n) in enumerate(cases):  # blocks of their own
        need = -(-(context + n) // block_size)
        tables[r, :need] = pool[used : used + need]
        used += need
        # Keys turning along the queries' shared direction with their position: each
        # chunk's scores are larger than the last's, so the running maximum moves on.
        ramp = torch.linspace(0, 3, need * block_size).view(need, block_size, 1, 1)
        cache[0][tables[r, :need].long()] += ramp / head_dim**0.5
    cache = cache.to(kv_dtype)
    lens = torch.tensor([n for _, n in cases])
    starts = torch.cumsum(lens, 0) - lens
    contexts = torch.tensor([c for c, _ in cases])
    q = torch.randn(int(lens.sum()), kv_heads * group, head_dim, generator=gen) + 0.5
    out, lse = torch.ops.pagellm.paged_prefill_attention(
        q, cache[0], cache[1], tables, starts, lens, contexts, scale, group, None, 0, True)
    rounded = (q * scale).bfloat16().double()
    for r, (context, n) in enumerate(cases):
        k, v = (cache[i][tables[r].long()].reshape(-1, kv_heads, head_dim)[: context + n]
                .bfloat16().double() for i in range(2))
        queries = rounded[starts[r] : starts[r] + n].view(n, kv_heads, group, head_dim)
        scores = torch.einsum("nhgd,khd->nhgk", queries, k)
        limits = context + torch.arange(n) + 1
        scores = scores.masked_fill(torch.arange(context + n) >= limits[:, None, None, None],
                                    float("-inf"))
        expected = torch.einsum("nhgk,khd->nhgd", scores.softmax(-1), v)
        got = out[starts[r] : starts[r] + n].double().view(n, kv_heads, group, head_dim)
        # Probabilities rounded to 8 significant bits: ~0.2% of an output's scale.
        torch.testing.assert_close(got, expected, atol=6e-3, rtol=1e-2)
        assert (got - expected).abs().mean() < 5e-4
        rows = slice(int(starts[r]) * group, int(starts[r] + n) * group)
        torch.testing.assert_close(
            lse[:, rows].double(),
            torch.logsumexp(scores, -1).permute(1, 0, 2).reshape(kv_heads, -1),
            atol=3e-3, rtol=1e-3)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_products_read_a_float32_pool_as_its_bfloat16_copy(head_dim: int) -> None:
    """With bf16_products, a float32 pool gives the very bits of its `.bfloat16()` copy
    (torch's rounding, which the bfloat16 pool's store uses), exact ties, values rounding
    up to the next power of two and denormals included: the prefill kernel and the prefix
    state. What lets a bfloat16 pool change no output in this mode."""
    bf16_products_or_skip(True)
    gen = torch.Generator().manual_seed(head_dim)
    cache = torch.randn(2, 30, 16, 2, head_dim, generator=gen)
    flat = cache.view(-1)
    bits = flat.view(torch.int32)
    picks = torch.randperm(flat.numel(), generator=gen)
    quarter = flat.numel() // 4
    ties, carries, tiny = picks[:quarter], picks[quarter:2 * quarter], picks[2 * quarter:3 * quarter]
    bits[ties] = (bits[ties] & -65536) | 0x8000  # halfway between two bfloat16
    bits[carries] = (bits[carries] & -8388608) | 0x7FFFFF  # rounds up to the next power of 2
    flat[tiny] = torch.randn(quarter, generator=gen) * 1e-39  # float32 denormals
    copy = cache.bfloat16()
    table = torch.randperm(30, generator=gen)[:20].int()[None]
    q = torch.randn(40, 6, head_dim, generator=gen)
    args = (table, torch.tensor([0]), torch.tensor([40]), torch.tensor([250]), 0.125, 3)
    ours, theirs = (torch.ops.pagellm.paged_prefill_attention(q, c[0], c[1], *args, None, 0,
                                                              True)
                    for c in (cache, copy))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    states = [torch.ops.pagellm.paged_prefix_state(q, c[0], c[1], table[0, :6], 0.125, 3,
                                                   True) for c in (cache, copy)]
    assert torch.equal(states[0], states[1])


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (1, 64), (2, 64), (5, 64), (8, 64),
                                               (9, 64), (1, 128), (4, 128), (9, 128)])
@pytest.mark.parametrize("context", [100, 95])
def test_a_prompt_row_never_depends_on_its_tile_or_chunk(kv_dtype: torch.dtype, bf16: bool,
                                                         group: int, head_dim: int,
                                                         context: int) -> None:
    """A query's bits are the same in a 30-query chunk (row tiles of up to 64 rows), in
    a chunk cut elsewhere, alone and beside its neighbour: its tile's rows reach
    different keys, so the tile's last key chunk holds an odd or an even number of keys
    (with bfloat16 products, an odd last key is paired with a zero in one tile and with a
    masked key in another). A tile of at most 8 rows (one or two queries' heads here, a
    decode's) takes its scores with keys in the lanes, and its rows may see different
    numbers of keys (masks; after 95 keys, the first query's rows none of the second's
    last chunk), in output passes of just its rows where it has fewer than a pass's (6
    rows for 64 dims, 3 for 128); 9 rows go the other way."""
    bf16_products_or_skip(bf16)
    gen = torch.Generator().manual_seed(7 + group)
    kv_heads, n = 3, 30
    cache = torch.randn(2, 20, 16, kv_heads, head_dim, generator=gen).to(kv_dtype)
    table = torch.randperm(20, generator=gen)[:9].int()[None]
    q = torch.randn(n, kv_heads * group, head_dim, generator=gen)

    def attend(first: int, count: int) -> torch.Tensor:
        result: torch.Tensor = torch.ops.pagellm.paged_prefill_attention(
            q[first : first + count], cache[0], cache[1], table, torch.tensor([0]),
            torch.tensor([count]), torch.tensor([context + first]), 0.125, group, None, 0,
            bf16)[0]
        return result

    whole = attend(0, n)
    assert torch.equal(torch.cat([attend(0, 13), attend(13, n - 13)]), whole)
    for i in range(n):
        assert torch.equal(attend(i, 1), whole[i : i + 1]), i
    for i in range(0, n, 2):
        assert torch.equal(attend(i, 2), whole[i : i + 2]), i


def test_bf16_products_are_refused_where_the_build_has_none() -> None:
    """Without AVX-512 BF16 (an AVX2 or older AVX-512 build: see the narrower-build
    test), asking for bfloat16 products is an error that says why, not float32 quietly."""
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    if torch.ops.pagellm.bf16_products_available():
        pytest.skip("this build has bfloat16 products")
    cache = torch.randn(2, 4, 16, 2, 64)
    q = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="bf16_products needs AVX-512 BF16"):
        torch.ops.pagellm.paged_prefix_state(q, cache[0], cache[1],
                                             torch.zeros(1, dtype=torch.int32), 0.1, 2, True)
    with pytest.raises(RuntimeError, match="bf16_products needs AVX-512 BF16"):
        torch.ops.pagellm.paged_prefill_attention(
            q, cache[0], cache[1], torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0]),
            torch.tensor([1]), torch.tensor([5]), 0.1, 2, None, 0, True)


def test_prefix_state_is_refused_where_it_cannot_go_on() -> None:
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    cache = torch.randn(2, 20, 16, 2, 64)
    q = torch.randn(2, 4, 64)
    tables = torch.arange(20, dtype=torch.int32).view(2, 10)
    shared = torch.arange(3, dtype=torch.int32)
    state = torch.ops.pagellm.paged_prefix_state(q, cache[0], cache[1], shared, 0.1, 2)
    args = (q, cache[0], cache[1], tables, torch.tensor([0, 1]), torch.tensor([1, 1]))

    def call(contexts: list[int], prior: torch.Tensor, keys: int) -> None:
        torch.ops.pagellm.paged_prefill_attention(*args, torch.tensor(contexts), 0.1, 2,
                                                  prior, keys)

    with pytest.raises(RuntimeError, match="multiple of 48"):
        call([60, 60], state, 40)
    with pytest.raises(RuntimeError, match="fewer than the prior state's 48"):
        call([60, 30], state, 48)
    with pytest.raises(RuntimeError, match=r"\[Hkv, rows, D \+ 2\]"):
        call([60, 60], state[:, :2], 48)
    call([60, 60], state, 48)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("block_size", [16, 5, 80])
def test_row_invariant_attention_gives_each_request_its_bits_alone(
        block_size: int, bf16: bool) -> None:
    """With use_row_invariant_attention, a step of decodes sharing a long prefix (the
    state cascade), decodes of their own and a prompt chunk gives every request the same
    bits as a step holding it alone; and the cascade runs. With float32 or bfloat16
    products."""
    bf16_products_or_skip(bf16)
    shared_blocks = -(-256 // block_size)
    shared = shared_blocks * block_size
    shapes = [(shared + 3, 1)] * 12 + [(shared + 40, 1), (shared + 20, 9)]
    case = make_case(4, shapes, shared_blocks=shared_blocks, block_size=block_size,
                     head_dim=64)
    backend = get_attention_backend("torch_batched")
    backend.configure([case["spec"]])
    backend.use_cpu_kernels()
    assert backend.use_row_invariant_attention(bf16)
    assert backend._bf16_products == bf16
    cache = case["cache"].clone()
    plan = backend.prepare(case["meta"])
    step = math.lcm(block_size, 48)  # whole blocks, whole 48-key chunks of the kernel
    assert len(plan.cascades) == 1 and plan.cascades[0].prior_keys == shared // step * step
    assert plan.groups == [] and plan.decode_call is None
    out = backend.forward(case["query"], case["key"], case["value"], cache, plan, case["spec"])
    tolerance = 1e-2 if bf16 else 2e-5  # bfloat16 probabilities: ~0.2% of the scale
    torch.testing.assert_close(out.double(), case["expected"], atol=tolerance, rtol=1e-5)
    row = 0
    for r, (context, n) in enumerate(shapes):
        alone_meta = build_metadata([case["tables"][r]], [context], [n], block_size)
        alone_plan = backend.prepare(alone_meta)
        assert not alone_plan.cascades
        got = backend.attend(case["query"][row:row + n], cache, alone_plan, case["spec"])
        assert torch.equal(got, out[row:row + n]), r
        row += n


def test_prefix_kernel_refuses_no_queries_and_blocks_outside_the_cache() -> None:
    if not kernels_loaded():
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    cache = torch.randn(2, 4, 16, 2, 64)
    for op in (torch.ops.pagellm.paged_prefix_attention, torch.ops.pagellm.paged_prefix_state):
        with pytest.raises(RuntimeError, match="no queries"):
            op(torch.randn(0, 4, 64), cache[0], cache[1], torch.zeros(1, dtype=torch.int32),
               0.1, 2)
        for bad in (4, -1):
            with pytest.raises(RuntimeError, match=f"block {bad} is outside the cache"):
                op(torch.randn(1, 4, 64), cache[0], cache[1],
                   torch.tensor([0, bad], dtype=torch.int32), 0.1, 2)
    with pytest.raises(RuntimeError, match="prior_keys without a prior_state"):
        torch.ops.pagellm.paged_prefill_attention(
            torch.randn(1, 4, 64), cache[0], cache[1], torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([0]), torch.tensor([1]), torch.tensor([50]), 0.1, 2, None, 48)
