"""The reference backend: plain, per request, what every other backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.core.kv_cache_manager import blocks_for_tokens
from pagellm.model.attention.base import AttentionBackend, AttentionSpec, StepPlan, window_mask


class TorchRefBackend(AttentionBackend):
    """The reference: one SDPA call per request over its gathered blocks.

    Deliberately plain (exact gathers, an explicit mask with the context offset) so it is
    easy to trust; every other backend is tested against it. SDPA's own `is_causal` is not
    used because it aligns the triangle top-left, which is wrong once the query is shorter
    than the keys (a prefix hit, a chunk, a decode).
    """

    name = "torch_ref"

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan, spec: AttentionSpec
    ) -> torch.Tensor:
        meta = plan.meta
        block_size = kv_cache.shape[2]
        out = torch.empty_like(query)
        start = 0
        for r, (seq_len, q_len) in enumerate(
            zip(meta.seq_lens_list, meta.query_lens_list, strict=True)
        ):
            n_blocks = blocks_for_tokens(seq_len, block_size)
            blocks = meta.block_tables[r, :n_blocks].long()
            keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].to(query.dtype)
            values = kv_cache[1, blocks].flatten(0, 1)[:seq_len].to(query.dtype)
            key_pos = torch.arange(seq_len, device=query.device)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
            mask = window_mask(key_pos <= query_pos, key_pos, query_pos, spec.sliding_window)
            q = query[start : start + q_len].transpose(0, 1)[None]
            attn = F.scaled_dot_product_attention(
                q,
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=mask,
                scale=spec.scale,
                enable_gqa=spec.num_heads != spec.num_kv_heads,
            )
            out[start : start + q_len] = attn[0].transpose(0, 1)
            start += q_len
        return out
