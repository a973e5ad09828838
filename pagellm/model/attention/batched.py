"""The default backend: requests of similar shape share one padded SDPA call, with a
cascade over a shared prefix on the CPU, the compiled CPU kernels where they serve, and
the fixed-shape decode of a CUDA graph."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagellm.core.kv_cache_manager import blocks_for_tokens
from pagellm.model.attention.base import (
    AttentionBackend,
    AttentionSpec,
    GraphDecodePlan,
    StepPlan,
    additive_scores,
    window_mask,
    write_kv_cache,
)
from pagellm.model.attention_metadata import AttentionMetadata


@dataclass
class _Group:
    """Requests attended by one padded SDPA call, and where their tokens live in the batch.

    q_src[Rg, Q]: batch row of each padded query (padding points at row 0, harmless).
    out_dst[Rg, Q]: batch row each result goes to (padding goes to a dump row T); None
    when the group is the whole batch in order with no padding, so results need no scatter.
    """

    blocks: torch.Tensor  # [Rg * n_blocks] block ids, flattened (after the shared prefix)
    n_requests: int
    q_len: int
    q_src: torch.Tensor
    out_dst: torch.Tensor | None
    key_pos: torch.Tensor  # [L] absolute position of each gathered key
    query_pos: torch.Tensor  # [Rg, Q, 1] absolute position of each query
    # Blocks every request of the group starts with, attended once for all (cascade).
    prefix_blocks: torch.Tensor | None = None
    # When those blocks are consecutive ids (the usual case: one request computed the
    # prefix into freshly allocated blocks), their first id: the cache is read in place.
    prefix_start: int | None = None
    # No request has context before its queries: key j is position j and SDPA's own
    # (top-left) causal masking is exact for every real query row.
    fresh: bool = False
    # With the compiled kernels: the shared prefix's block ids as int32 (read in place by
    # the prefix kernel); for decode groups (one query per request) each request's blocks
    # after that prefix [Rg, W] int32 and how many keys they hold [Rg] (the decode kernel).
    prefix_ids: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    key_lens: torch.Tensor | None = None
    additive_masks: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(
        default_factory=dict
    )

    def additive_mask(self, window: int | None, repeat: int, dtype: torch.dtype) -> torch.Tensor:
        """The causal (and windowed) mask as 0 / -inf scores, each query row repeated
        `repeat` times in a row ([Rg, 1, Q * repeat, L], the layout of grouped heads folded
        into the queries). Built once per step: every layer would rebuild the same tensor."""
        key = (window, repeat, dtype)
        cached = self.additive_masks.get(key)
        if cached is None:
            causal = self.key_pos <= self.query_pos
            mask = window_mask(causal, self.key_pos, self.query_pos, window)[:, None]
            r, _, q, length = mask.shape
            mask = mask[:, :, :, None, :].expand(r, 1, q, repeat, length)
            cached = additive_scores(mask, dtype).view(r, 1, q * repeat, length)
            self.additive_masks[key] = cached
        return cached


@dataclass
class _PrefillCall:
    """With the kernels, every prompt chunk of the step in one call of the prefill kernel:
    each request's table read in place, causally, no padding (see `use_cpu_kernels`)."""

    tables: torch.Tensor  # [R, W] int32: each request's blocks, context and new tokens
    starts: torch.Tensor  # [R] int64: batch row of each request's first query
    lens: torch.Tensor  # [R] int64: its queries
    contexts: torch.Tensor  # [R] int64: tokens before its first query
    # Batch row of each result, request after request; None when the call is the whole
    # batch, so its results need no scatter.
    out_dst: torch.Tensor | None


@dataclass
class _StateCascade:
    """Row-invariant attention's cascade (see use_row_invariant_attention): decodes that
    share a prefix get its softmax state in one call for all of them (the prefix read
    once), then the prefill kernel goes on from it over each one's own keys."""

    call: _PrefillCall  # the decodes, each request's keys after the prefix's
    prefix_ids: torch.Tensor  # [n] int32: the shared prefix's blocks
    prior_keys: int  # the prefix's keys: a multiple of the prefill kernel's key chunk
    q_rows: torch.Tensor | None  # batch rows of the decodes' queries; None: the whole batch


@dataclass
class _BatchedPlan(StepPlan):
    groups: list[_Group] = field(default_factory=list)
    prefill: _PrefillCall | None = None
    cascades: list[_StateCascade] = field(default_factory=list)


class TorchBatchedBackend(AttentionBackend):
    """No per-request loop: requests of similar shape share one padded SDPA call.

    Requests are grouped by (query length, number of blocks), each rounded up to a power of
    two, so padding at most doubles a group's work: one padded call over a batch of
    decodes plus one long prefill, or over short and very long contexts, would multiply
    it by the longest length instead. A typical step has one to three groups. Each group
    gathers its requests' blocks with one `index_select` into a reused workspace (on CPU,
    allocating a fresh tens-of-MB buffer per layer costs more than the copy itself), then
    makes one SDPA call with a [R, 1, Q, L] mask.

    Decode fast path: with one query per request, the G query heads that share a KV head are
    folded into the query-length axis ([R, Hkv, G, D] against [R, Hkv, L, D]), so GQA needs
    no repeat of K/V and no causal mask beyond each request's length.
    """

    name = "torch_batched"

    def __init__(self) -> None:
        self._workspaces: dict[str, torch.Tensor] = {}
        self._cascade = True
        self._specs: list[AttentionSpec] = []
        self._decode_kernel = False
        self._write_kernel = False
        self._row_invariant = False
        self._bf16_products = False

    def configure(self, specs: list[AttentionSpec]) -> None:
        # A shared prefix is attended whole, which a sliding-window layer must not do.
        self._cascade = all(spec.sliding_window is None for spec in specs)
        self._specs = list(specs)

    def supports_graph_decode(self) -> bool:
        return True

    def use_cpu_kernels(self) -> None:
        """Decode groups read the cache through the compiled paged kernel instead of a
        gather and SDPA (about half the attention time of a decode step measured here),
        and every prompt chunk of a step goes through one call of the prefill kernel,
        where every layer fits them: no sliding window, G <= 8 query heads per kv head of
        64 or 128 dims. New K/V rows are stored by one compiled op per layer.

        For a float32 model on the CPU only (the loader calls it only then): the ops
        refuse anything else, and nothing here falls back."""
        self._write_kernel = True
        self._decode_kernel = bool(self._specs) and all(
            spec.sliding_window is None and spec.head_dim in (64, 128)
            and spec.num_heads % spec.num_kv_heads == 0
            and spec.num_heads // spec.num_kv_heads <= 8
            for spec in self._specs)

    def use_row_invariant_attention(self, bf16_products: bool) -> bool:
        """Every token, decodes included, through the prefill kernel: it computes a
        query's row with the same float32 steps whatever rows, chunk or context share
        its call (its keys in chunks of 48 from the first, its scores one chain of FMAs
        over the dims), where the decode kernel and a cascade's merge add in other
        orders. Decodes sharing a long prefix still read it once for all: the prefix
        kernel gives their softmax state after it, and the prefill kernel goes on from
        there (`_StateCascade`), which is the same arithmetic as one pass. Only where the
        kernels serve every layer (the prefill kernel takes blocks of any size).
        With `bf16_products` (where bf16_products_available), both kernels round queries,
        keys, probabilities and values to bfloat16 and take their products in pairs,
        twice an FMA's work per instruction; still the same steps for every row."""
        self._row_invariant = self._decode_kernel
        self._bf16_products = self._row_invariant and bf16_products
        return self._row_invariant

    def prepare(self, meta: AttentionMetadata) -> StepPlan:
        if self._row_invariant:
            return self._prepare_row_invariant(meta)
        device = meta.slot_mapping.device
        buckets: dict[tuple[int, int, int], list[int]] = {}
        # The cascade saves memory traffic for a few more ops per layer. A GPU step of
        # this engine is bound by kernel launches, not traffic: on an H200 (SmolLM2-135M
        # shape, float32) decode with a shared prefix ran 1.1-2.1x slower with it, from
        # 8 x 256 to 64 x 4,096 shared tokens, so only the CPU cascades.
        cascade = self._cascade and device.type == "cpu"
        kernel = self._decode_kernel and meta.block_size <= MAX_KERNEL_BLOCK_SIZE
        first_blocks = self._shared_first_blocks(meta, cascade, kernel)
        lengths = zip(meta.query_lens_list, meta.seq_lens_list, strict=True)
        for r, (q_len, seq_len) in enumerate(lengths):
            shared = first_blocks.get(r, -1)
            if kernel and q_len > 1:
                key = _PREFILL_CALL
            elif kernel and q_len == 1 and shared < 0:
                key = _DECODE_CALL
            elif shared >= 0:
                # Requests that start on the same cached block share a prefix: one group
                # (decodes apart from prefills, so decodes are not padded to a chunk).
                key = (min(q_len - 1, 1), -1, shared)
            else:
                n_blocks = blocks_for_tokens(seq_len, meta.block_size)
                key = ((q_len - 1).bit_length(), n_blocks.bit_length(), -1)
            buckets.setdefault(key, []).append(r)
        if kernel:
            _fold_small_decode_groups(meta, buckets)
        whole = len(buckets) == 1
        prefill = buckets.pop(_PREFILL_CALL, None)
        # The one decode-kernel call never cascades: a group sharing enough to pay has a
        # bucket of its own (see _fold_small_decode_groups).
        groups = [
            self._group(meta, members, device, whole, cascade and key != _DECODE_CALL, kernel)
            for key, members in buckets.items()
        ]
        decode_call = None
        if prefill is None and len(groups) == 1:
            (only,) = groups
            if only.tables is not None and only.out_dst is None:
                assert only.key_lens is not None
                decode_call = (only.tables, only.key_lens, only.prefix_ids, None, False)
        return _BatchedPlan(meta, groups,
                            None if prefill is None else _prefill_call(meta, prefill, whole),
                            decode_call=decode_call)

    def _prepare_row_invariant(self, meta: AttentionMetadata) -> StepPlan:
        """Every request through the prefill kernel, except decodes sharing a prefix
        worth a cascade (as `_fold_small_decode_groups` decides it), which go on from its
        state. The prefix is cut to a multiple of the kernel's key chunk, so that going
        on from it is the same arithmetic as one pass."""
        sharing: dict[int, list[int]] = {}
        for r, block in self._shared_first_blocks(meta, self._cascade, True).items():
            sharing.setdefault(block, []).append(r)
        step = math.lcm(meta.block_size, PREFILL_KEY_CHUNK)
        alone = set(range(meta.num_requests))
        cascades = []
        for members in sharing.values():
            keys = _shared_prefix_blocks(meta, members) * meta.block_size // step * step
            if keys == 0 or len(members) * keys < MIN_DECODE_CASCADE_KEYS:
                continue
            alone -= set(members)
            cascades.append((sorted(members), keys))
        whole = not cascades or (len(cascades) == 1 and not alone)
        plans = []
        for members, keys in cascades:
            index = torch.tensor(members, device=meta.slot_mapping.device)
            plans.append(_StateCascade(
                _prefill_call(meta, members, whole),
                meta.block_tables[members[0], :keys // meta.block_size].contiguous(), keys,
                None if whole else meta.query_start_loc[index].long()))
        prefill = _prefill_call(meta, sorted(alone), whole) if alone else None
        decode_call = None
        if prefill is not None and whole and max(meta.query_lens_list) == 1:
            # Decodes only, no cascade: the layer may run as one decode_layer call.
            rows = torch.stack([prefill.starts, prefill.lens, prefill.contexts])
            decode_call = (prefill.tables, meta.seq_lens, None, rows, self._bf16_products)
        return _BatchedPlan(meta, [], prefill, cascades=plans, decode_call=decode_call)

    @staticmethod
    def _shared_first_blocks(meta: AttentionMetadata, cascade: bool,
                             kernel: bool) -> dict[int, int]:
        """Request -> its first block, for requests that share that block with another
        request and have enough context before their queries for a cascade to pay. With
        the kernels only decodes cascade (every prompt chunk goes to the prefill call)."""
        if not cascade or meta.num_requests < 2:
            return {}
        min_context = MIN_CASCADE_BLOCKS * meta.block_size
        candidates = [
            r
            for r, (q_len, seq_len) in enumerate(
                zip(meta.query_lens_list, meta.seq_lens_list, strict=True)
            )
            if seq_len - q_len >= min_context and not (kernel and q_len > 1)
        ]
        if len(candidates) < 2:
            return {}
        firsts = meta.block_tables[candidates, 0].tolist()
        counts: dict[int, int] = {}
        for block in firsts:
            counts[block] = counts.get(block, 0) + 1
        return {
            r: block for r, block in zip(candidates, firsts, strict=True) if counts[block] > 1
        }

    @staticmethod
    def _group(
        meta: AttentionMetadata,
        members: list[int],
        device: torch.device,
        whole: bool,
        cascade: bool,
        kernel: bool,
    ) -> _Group:
        """One bucket's plan. With the kernels every group is decodes (prompt chunks go to
        the prefill call), so it carries the decode kernel's tables."""
        block_size = meta.block_size
        q_lens = [meta.query_lens_list[r] for r in members]
        max_q = max(q_lens)
        assert not kernel or max_q == 1, "with the kernels prompt chunks go to the prefill call"
        max_seq = max(meta.seq_lens_list[r] for r in members)
        n_blocks = blocks_for_tokens(max_seq, block_size)
        index = torch.tensor(members, device=device)
        n_prefix = _shared_prefix_blocks(meta, members) if cascade else 0
        prefix_blocks = meta.block_tables[index[0], :n_prefix].long() if n_prefix else None
        blocks = meta.block_tables[index, n_prefix:n_blocks].long().flatten()
        starts = meta.query_start_loc[index].long()
        seq_lens = meta.seq_lens[index].long()
        q_lens_t = meta.query_start_loc[index + 1].long() - starts
        offsets = torch.arange(max_q, device=device)
        valid = offsets[None, :] < q_lens_t[:, None]
        rows = starts[:, None] + offsets[None, :]
        q_src = rows.masked_fill(~valid, 0)
        num_tokens = meta.slot_mapping.shape[0]
        no_padding = whole and min(q_lens) == max_q
        out_dst = None if no_padding else rows.masked_fill(~valid, num_tokens)
        # Padded query rows are clamped to the request's last position so they never look
        # past its end; their results are dropped anyway.
        context = (seq_lens - q_lens_t)[:, None]
        query_pos = torch.minimum(context + offsets[None, :], seq_lens[:, None] - 1)
        return _Group(
            blocks=blocks,
            n_requests=len(members),
            q_len=max_q,
            q_src=q_src.flatten(),
            out_dst=None if out_dst is None else out_dst.flatten(),
            key_pos=torch.arange(n_prefix * block_size, n_blocks * block_size, device=device),
            query_pos=query_pos[:, :, None],
            prefix_blocks=prefix_blocks,
            prefix_start=_consecutive_start(prefix_blocks),
            fresh=all(meta.seq_lens_list[r] == meta.query_lens_list[r] for r in members),
            prefix_ids=prefix_blocks.int() if kernel and prefix_blocks is not None else None,
            tables=meta.block_tables[index, n_prefix:n_blocks].contiguous() if kernel else None,
            key_lens=(seq_lens - n_prefix * block_size).int() if kernel else None,
        )

    def _gather(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype,
        slot: str = "blocks"
    ) -> torch.Tensor:
        """Copy the listed blocks of K and V into the `slot` workspace: [2, n, B, Hkv, D],
        as `dtype` (the queries'; a copy more where the cache is kept in another)."""
        n = blocks.shape[0]
        per_block = kv_cache.shape[2:]
        ws = self._workspaces.get(slot)
        if (
            ws is None
            or ws.shape[1] < n
            or ws.shape[2:] != per_block
            or ws.dtype != kv_cache.dtype
            or ws.device != kv_cache.device
        ):
            ws = torch.empty((2, n, *per_block), dtype=kv_cache.dtype, device=kv_cache.device)
            self._workspaces[slot] = ws
        out = ws[:, :n]
        for i in range(2):
            torch.index_select(kv_cache[i].flatten(1), 0, blocks, out=out[i].view(n, -1))
        return out.to(dtype)

    def write(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: StepPlan
    ) -> None:
        if self._write_kernel:
            torch.ops.pagellm.write_kv_cache_(kv_cache, key, value, plan.meta.slot_mapping)
        else:
            write_kv_cache(kv_cache, key, value, plan.meta.slot_mapping)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan, spec: AttentionSpec
    ) -> torch.Tensor:
        if isinstance(plan, GraphDecodePlan):
            return self._attend_graph_decode(query, kv_cache, plan, spec)
        assert isinstance(plan, _BatchedPlan)
        num_tokens = query.shape[0]
        parts = [(self._attend(query, kv_cache, group, spec), group.out_dst)
                 for group in plan.groups]
        parts += [(self._state_cascade(query, kv_cache, cascade, spec), cascade.call.out_dst)
                  for cascade in plan.cascades]
        if plan.prefill is not None:
            parts.append((self._prefill_with_kernel(query, kv_cache, plan.prefill, spec),
                          plan.prefill.out_dst))
        if len(parts) == 1 and parts[0][1] is None:
            return parts[0][0]
        out = query.new_empty((num_tokens + 1, spec.num_heads, spec.head_dim))
        for result, out_dst in parts:
            assert out_dst is not None
            out.index_copy_(0, out_dst, result)
        return out[:num_tokens]

    @staticmethod
    def _attend_graph_decode(
        query: torch.Tensor, kv_cache: torch.Tensor, plan: GraphDecodePlan, spec: AttentionSpec
    ) -> torch.Tensor:
        """Every row's query against all W blocks of its table, masked past its length:
        [R, H, D]. Fixed shapes and no host reads, so a CUDA graph can hold it. The
        gathered keys are fresh tensors, not the shared workspace of `_gather`: a graph
        keeps the addresses it was captured with, and the workspace may be reallocated by
        a later eager step.

        Written as two batched matmuls around a float32 softmax, not SDPA: with one query
        per request, SDPA's fused kernels tile 64 queries and walk the keys serially, so a
        step of few requests keeps few of the GPU's cores busy (on an H200, 1 request over
        1,024 tokens: 9.8 ms a step through SDPA's kernel, against 4.3 ms over 128); the
        matmuls spread the keys over the whole GPU, and the scores they write are small
        ([R, H, L])."""
        meta = plan.meta
        rows = meta.block_tables.shape[0]
        hkv, d = spec.num_kv_heads, spec.head_dim
        blocks = meta.block_tables.flatten()
        keys = (kv_cache[0].index_select(0, blocks).to(query.dtype)
                .view(rows, -1, hkv, d).permute(0, 2, 3, 1))
        values = (kv_cache[1].index_select(0, blocks).to(query.dtype)
                  .view(rows, -1, hkv, d).transpose(1, 2))
        folded = query.view(rows, hkv, spec.num_heads // hkv, d)
        scores = torch.matmul(folded, keys).float() * spec.scale
        scores += plan.additive_mask(spec.sliding_window, torch.float32)
        probs = scores.softmax(dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(rows, spec.num_heads, d)

    def _attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: _Group, spec: AttentionSpec
    ) -> torch.Tensor:
        """Attention for one group: [Rg * Q, H, D], padded rows included."""
        r, q_len, hkv, d = group.n_requests, group.q_len, spec.num_kv_heads, spec.head_dim
        if group.tables is not None:
            # The whole batch in order (a decode step): the kernel reads the queries where
            # they are, a strided view of the qkv output.
            in_place = group.out_dst is None
            q = query if in_place else query.index_select(0, group.q_src)
            return self._decode_with_kernel(q, kv_cache, group, spec)
        q = query.index_select(0, group.q_src)
        kv = self._gather(kv_cache, group.blocks, q.dtype).view(2, r, -1, hkv, d).transpose(2, 3)
        # Fresh prompts use the kernel's built-in causal mask, about 2x faster than an
        # explicit one; padded keys sit after every real query, so they stay masked.
        builtin_causal = q_len > 1 and group.fresh and spec.sliding_window is None
        if not builtin_causal and group.prefix_blocks is not None:
            return self._attend_cascade(q, kv, kv_cache, group, spec)
        mask = None if builtin_causal else group.additive_mask(spec.sliding_window, 1, q.dtype)
        if q_len == 1:
            folded = q.view(r, hkv, spec.num_heads // hkv, d)
            attn = F.scaled_dot_product_attention(
                folded, kv[0], kv[1], attn_mask=mask, scale=spec.scale
            )
            return attn.reshape(r, spec.num_heads, d)
        attn = F.scaled_dot_product_attention(
            q.view(r, q_len, spec.num_heads, d).transpose(1, 2),
            kv[0],
            kv[1],
            attn_mask=mask,
            is_causal=builtin_causal,
            scale=spec.scale,
            enable_gqa=spec.num_heads != hkv,
        )
        return attn.transpose(1, 2).reshape(r * q_len, spec.num_heads, d)


    def _attend_prefix(
        self, shared_q: torch.Tensor, kv_cache: torch.Tensor, group: _Group, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query of the group [Hkv, M, D] against the shared prefix, unmasked:
        output [Hkv, M, D] and log-sum-exp [Hkv, M], without the kernels (with them, a
        decode cascade goes through `_decode_prefix`): the blocks are gathered, unless
        consecutive, and attended by SDPA."""
        assert group.prefix_blocks is not None
        if group.prefix_start is None:
            prefix = self._gather(kv_cache, group.prefix_blocks, shared_q.dtype, "prefix")
        else:
            end = group.prefix_start + group.prefix_blocks.shape[0]
            prefix = kv_cache[:, group.prefix_start : end].to(shared_q.dtype)
        prefix = prefix.reshape(2, -1, spec.num_kv_heads, spec.head_dim)
        out, lse = _attention_with_lse(
            shared_q[None], prefix[0].transpose(0, 1)[None], prefix[1].transpose(0, 1)[None],
            None, spec.scale)
        return out[0], lse[0]

    def _state_cascade(self, query: torch.Tensor, kv_cache: torch.Tensor,
                       cascade: _StateCascade, spec: AttentionSpec) -> torch.Tensor:
        """The cascade's decodes: the prefix's state for all of them, then each one's own
        keys from it: [members, H, D]. The same bits as attending each alone."""
        group = spec.num_heads // spec.num_kv_heads
        q = query if cascade.q_rows is None else query.index_select(0, cascade.q_rows)
        state = torch.ops.pagellm.paged_prefix_state(
            q, kv_cache[0], kv_cache[1], cascade.prefix_ids, spec.scale, group,
            self._bf16_products)
        return self._prefill_with_kernel(query, kv_cache, cascade.call, spec,
                                         (state, cascade.prior_keys))

    def _prefill_with_kernel(
        self, query: torch.Tensor, kv_cache: torch.Tensor, call: _PrefillCall,
        spec: AttentionSpec, prior: tuple[torch.Tensor, int] | None = None
    ) -> torch.Tensor:
        """Every prompt chunk's queries against its whole table, causally: [sum(lens), H,
        D]. The kernel reads the queries where they are (a strided view of the qkv output)
        and writes the output in the model's layout, so no gather, transposed copy,
        padding, mask or cascade merge is made. Against those (padded SDPA calls and
        cascades), on AVX2: multi-turn's prompt attention 1.30 -> 0.80 s in a profile, its
        prefill steps 5.6-5.9 -> 5.1 s; shared-prefix's 4.2-4.3 -> 3.9-4.0 s (the shared
        prefix, read once per request instead of once, costs nothing seen: the chunks are
        compute-bound). With `prior` (a prefix state and its keys, from `_state_cascade`),
        each row goes on from that state."""
        state, prior_keys = prior if prior is not None else (None, 0)
        result: tuple[torch.Tensor, torch.Tensor] = torch.ops.pagellm.paged_prefill_attention(
            query, kv_cache[0], kv_cache[1], call.tables, call.starts, call.lens,
            call.contexts, spec.scale, spec.num_heads // spec.num_kv_heads, state, prior_keys,
            self._bf16_products)
        return result[0]

    def _decode_with_kernel(
        self, q: torch.Tensor, kv_cache: torch.Tensor, group: _Group, spec: AttentionSpec
    ) -> torch.Tensor:
        """One query per request against its blocks, read in place: [r, H, D].

        With a shared prefix (a cascade), the prefix kernel first attends every request's
        query heads to it at once, streaming the prefix once per step instead of once per
        request (32 requests over 1,024 shared tokens: 0.51-0.74 -> 0.26-0.28 ms per layer
        here, in two measurements); the decode kernel then attends each request's own
        blocks and merges the two."""
        assert group.tables is not None and group.key_lens is not None
        q = q.view(group.n_requests, spec.num_heads, spec.head_dim)
        prior: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None)
        if group.prefix_blocks is not None:
            prior = self._decode_prefix(q, kv_cache, group, spec)
        out: tuple[torch.Tensor, torch.Tensor] = torch.ops.pagellm.paged_decode_attention(
            q, kv_cache[0], kv_cache[1], group.tables, group.key_lens, spec.scale, *prior)
        return out[0]

    def _decode_prefix(
        self, q: torch.Tensor, kv_cache: torch.Tensor, group: _Group, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoding request's query heads [r, H, D] against the group's shared
        prefix at once: out [Hkv, r * G, D] and log-sum-exp [Hkv, r * G]. The prefix kernel
        reads the blocks in place (about 2x torch's flash kernel on contiguous K/V here)
        and the queries too, a strided view of the qkv output (laid out per kv head first,
        they were copied every layer, ~25 us with the Python around it)."""
        assert group.prefix_ids is not None
        result: tuple[torch.Tensor, torch.Tensor] = torch.ops.pagellm.paged_prefix_attention(
            q, kv_cache[0], kv_cache[1], group.prefix_ids, spec.scale,
            spec.num_heads // spec.num_kv_heads)
        return result

    def _attend_cascade(
        self,
        q: torch.Tensor,
        suffix_kv: torch.Tensor,
        kv_cache: torch.Tensor,
        group: _Group,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """Attention when every request of the group starts with the same blocks.

        The shared prefix is gathered once and attended by all queries of all requests in
        one call, instead of once per request; each request's own blocks are attended as
        usual. The two partial results are merged exactly through their log-sum-exps (the
        same attention, computed in another order). Every query sees the whole prefix (it
        lies before every query) and at least itself among its own keys, so neither part
        has a fully masked row.
        """
        assert group.prefix_blocks is not None
        r, q_len, hkv, d = group.n_requests, group.q_len, spec.num_kv_heads, spec.head_dim
        g = spec.num_heads // hkv
        # Queries as [r, hkv, Q * G, D]: the G heads sharing a KV head sit with their query.
        qh = q.view(r, q_len, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(r, hkv, q_len * g, d)
        shared_q = qh.transpose(0, 1).reshape(hkv, r * q_len * g, d)
        prefix_out, prefix_lse = self._attend_prefix(shared_q, kv_cache, group, spec)
        prefix_out = prefix_out.view(hkv, r, q_len * g, d).transpose(0, 1)
        prefix_lse = prefix_lse.view(hkv, r, q_len * g).transpose(0, 1)
        own_mask = group.additive_mask(spec.sliding_window, g, q.dtype)
        own_out, own_lse = _attention_with_lse(qh, suffix_kv[0], suffix_kv[1], own_mask,
                                               spec.scale)
        # Softmax over both parts = the parts weighted by their share of the total mass,
        # exp(lse_p) / (exp(lse_p) + exp(lse_o)) = sigmoid(lse_p - lse_o).
        prefix_share = torch.sigmoid(prefix_lse - own_lse)[..., None]
        out = torch.lerp(own_out.float(), prefix_out.float(), prefix_share).to(q.dtype)
        # [r, hkv, Q, G, D] -> [r * Q, H, D]
        out = out.view(r, hkv, q_len, g, d).permute(0, 2, 1, 3, 4)
        return out.reshape(r * q_len, spec.num_heads, d)


def _consecutive_start(blocks: torch.Tensor | None) -> int | None:
    """The first id of `blocks` when they are consecutive ids, else None."""
    if blocks is None:
        return None
    ids = blocks.tolist()
    return ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None


def _attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention [B, H, Q, D] and the log-sum-exp of its scores [B, H, Q] (for merging
    partial attentions), `additive_mask` added to the scores, through torch's CPU flash
    kernel, which returns both without materialising the scores (about 4x faster than
    computing them here). Only the CPU cascades (see `prepare`)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=additive_mask, scale=scale
    )
    return out, lse


# The paged decode kernel's largest block (tokens per KV block).
MAX_KERNEL_BLOCK_SIZE = 64

# The prefill kernel's chunk of keys (kKeyChunk in csrc/paged_attention.cpp): a state it
# goes on from must end at a multiple of it.
PREFILL_KEY_CHUNK = 48

# A shared prefix shorter than this is not worth a second gather and softmax pass.
MIN_CASCADE_BLOCKS = 4

# With the kernels, a decode group cascades only when its requests would read at least
# this many shared keys in all: below it the decode kernel alone, reading each request's
# whole table, is as fast (measured here: a tie at 8 requests x 256 shared tokens or 32 x
# 64; the cascade 2.6x faster at 32 x 1,024).
MIN_DECODE_CASCADE_KEYS = 2048


# With the kernels, the bucket of decodes attended in one call of the decode kernel (any
# lengths), with no cascade.
_DECODE_CALL = (0, 0, -2)

# With the kernels, the bucket of every prompt chunk, one call of the prefill kernel.
_PREFILL_CALL = (1, 0, -3)


def _prefill_call(meta: AttentionMetadata, members: list[int], whole: bool) -> _PrefillCall:
    """The prefill kernel's arguments for `members` (requests in batch order)."""
    index = torch.tensor(members, device=meta.slot_mapping.device)
    starts = meta.query_start_loc[index].long()
    lens = meta.query_start_loc[index + 1].long() - starts
    n_blocks = blocks_for_tokens(max(meta.seq_lens_list[r] for r in members), meta.block_size)
    out_dst = None
    if not whole:
        offsets = torch.arange(int(lens.max()), device=starts.device)
        rows = starts[:, None] + offsets[None, :]
        out_dst = rows[offsets[None, :] < lens[:, None]]
    return _PrefillCall(
        tables=meta.block_tables[index, :n_blocks].contiguous(),
        starts=starts, lens=lens, contexts=meta.context_lens[index].long(),
        out_dst=out_dst)


def _fold_small_decode_groups(
    meta: AttentionMetadata, buckets: dict[tuple[int, int, int], list[int]]
) -> None:
    """Decodes that share a prefix too small for a cascade join the one decode-kernel
    call instead of making a call of their own (each costs a kernel launch per layer)."""
    for key in [k for k in buckets if k[0] == 0 and k[2] >= 0]:
        members = buckets[key]
        shared_keys = len(members) * _shared_prefix_blocks(meta, members) * meta.block_size
        if shared_keys < MIN_DECODE_CASCADE_KEYS:
            # In batch order: a lone group over the whole batch skips the result scatter.
            folded = buckets.pop(key) + buckets.pop(_DECODE_CALL, [])
            buckets[_DECODE_CALL] = sorted(folded)


def _shared_prefix_blocks(meta: AttentionMetadata, members: list[int]) -> int:
    """How many leading blocks all `members` share and have fully computed before their
    first query (0 when too few to be worth a cascade, or for a single request)."""
    if len(members) < 2:
        return 0
    block_size = meta.block_size
    visible = min(
        meta.seq_lens_list[r] - meta.query_lens_list[r] for r in members
    ) // block_size
    if visible < MIN_CASCADE_BLOCKS:
        return 0
    tables = meta.block_tables[members, :visible].cpu()
    same = (tables == tables[0]).all(dim=0)
    n_prefix = int(same.long().cumprod(0).sum())
    return n_prefix if n_prefix >= MIN_CASCADE_BLOCKS else 0
