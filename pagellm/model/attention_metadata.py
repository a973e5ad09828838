"""What one forward pass needs to know to read and write the paged KV cache.

The worker flattens every scheduled token of every request into one batch of T tokens
(requests in order, each request's tokens contiguous). This record tells the attention
layers where each new key/value goes and which blocks each request reads, so that one
code path serves fresh prefills, prefills over a cached prefix, prefill chunks and decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs for a batch of R requests holding T new tokens.

    All tensors live on the model's device.
    - slot_mapping[T] (int64): flat slot (block_id * block_size + offset) where each new
      token's K/V is written before attention reads the cache.
    - block_tables[R, max_blocks] (int32): the blocks of each request in order; entries past
      a request's last block are padding (any valid block id, never read).
    - seq_lens[R] (int32): tokens of context each request attends over after this step
      (cached/previously computed tokens + the new ones).
    - query_start_loc[R+1] (int32): request r's new tokens are [qsl[r], qsl[r+1]) of the batch.
    - context_lens[R] (int32): seq_lens - query lengths, the tokens already in the cache.
    The new token i of request r sits at position context_lens[r] + i and attends causally
    to keys 0 .. context_lens[r] + i.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Python-side copies of the small per-request vectors, so backends that loop or pad
    # do not force a device sync to read them.
    seq_lens_list: list[int]
    query_lens_list: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_list)
