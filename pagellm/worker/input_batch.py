"""Turns one scheduled step into the flat tensors a forward pass consumes.

Everything is built with numpy over per-request arrays (one Python iteration per
request, none per token), then moved to the device in one go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.model.attention_metadata import AttentionMetadata


@dataclass
class SequenceChunk:
    """One request's share of a step: `token_ids` are computed at positions
    `start_pos ..`, with KV written into its `block_ids`. `num_samples` rows of logits
    are taken at its last token (0 while a prompt chunk is still incomplete; more than 1
    when forked siblings sample their first token from the same logits).

    For prompt logprobs, `prompt_targets` are the prompt tokens that the chunk's first
    positions predict (position i, the token at i + 1), each scored with the
    `num_prompt_logprobs` most likely alternatives."""

    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    num_samples: int
    prompt_targets: list[int] = field(default_factory=list)
    num_prompt_logprobs: int = 0


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor


def prepare_inputs(
    chunks: list[SequenceChunk], block_size: int, device: torch.device
) -> ModelInputs:
    query_lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64,
                             count=len(chunks))
    context_lens = np.fromiter((c.start_pos for c in chunks), dtype=np.int64,
                               count=len(chunks))
    seq_lens = context_lens + query_lens
    query_start_loc = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    input_ids: list[int] = []
    for chunk in chunks:
        input_ids.extend(chunk.token_ids)

    num_blocks = np.fromiter((len(c.block_ids) for c in chunks), dtype=np.int64,
                             count=len(chunks))
    if (num_blocks * block_size < seq_lens).any():
        # Padding is block 0, a real block: a short table would write this step's keys
        # and values over another request's instead of failing.
        row = int(np.argmax(num_blocks * block_size < seq_lens))
        raise RuntimeError(f"chunk {row} of the step has {num_blocks[row]} blocks for "
                           f"{seq_lens[row]} tokens, {block_size} to a block")
    block_tables = np.zeros((len(chunks), int(num_blocks.max())), dtype=np.int64)
    for row, chunk in enumerate(chunks):
        block_tables[row, : len(chunk.block_ids)] = chunk.block_ids

    request_of_token = np.repeat(np.arange(len(chunks)), query_lens)
    positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - context_lens,
                                                  query_lens)
    slot_mapping = (block_tables[request_of_token, positions // block_size] * block_size
                    + positions % block_size)

    samples = np.fromiter((c.num_samples for c in chunks), dtype=np.int64, count=len(chunks))
    logits_indices = np.repeat(query_start_loc[1:] - 1, samples)

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    metadata = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.long),
        block_tables=to_device(block_tables, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        query_start_loc=to_device(query_start_loc, torch.int32),
        context_lens=to_device(context_lens, torch.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        seq_lens_list=seq_lens.tolist(),
        query_lens_list=query_lens.tolist(),
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=to_device(positions, torch.long),
        attn_metadata=metadata,
        logits_indices=to_device(logits_indices, torch.long),
    )
