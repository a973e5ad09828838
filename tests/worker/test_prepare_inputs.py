"""prepare_inputs: the flat tensors of one step, checked field by field against values
worked out by hand from each request's block table.

Attention trusts these blindly: a wrong position rotates the query by the wrong angle, a
wrong slot writes a token's KV where another request (or a later position) reads it, a
wrong logits index samples from a token that is not the last one known. None of that
crashes; it only makes the output worse, so each case is pinned exactly. The block ids
are scattered (not 0, 1, 2, ...) so that a slot taken from the wrong block, or from
another request's table, lands elsewhere.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from pagellm.worker.input_batch import ModelInputs, SequenceChunk, prepare_inputs

BLOCK = 4
CPU = torch.device("cpu")


def check(
    inputs: ModelInputs,
    *,
    input_ids: list[int],
    positions: list[int],
    slots: list[int],
    context_lens: list[int],
    seq_lens: list[int],
    query_start_loc: list[int],
    logits_indices: list[int],
    block_tables: list[list[int]],
) -> None:
    """Every field against the expected values; the rows of the block table are compared
    up to each request's own blocks (the padding after them is never read)."""
    md = inputs.attn_metadata
    assert inputs.input_ids.tolist() == input_ids
    assert inputs.positions.tolist() == positions
    assert md.slot_mapping.tolist() == slots
    assert md.context_lens.tolist() == context_lens
    assert md.seq_lens.tolist() == md.seq_lens_list == seq_lens
    assert md.query_start_loc.tolist() == query_start_loc
    query_lens = [end - start for start, end in pairwise(query_start_loc)]
    assert md.query_lens_list == query_lens
    assert md.max_query_len == max(query_lens) and md.max_seq_len == max(seq_lens)
    assert inputs.logits_indices.tolist() == logits_indices
    assert md.block_size == BLOCK
    assert md.block_tables.shape == (len(block_tables), max(map(len, block_tables)))
    for row, blocks in zip(md.block_tables.tolist(), block_tables, strict=True):
        assert row[: len(blocks)] == blocks
    # What the kernels index with: 64-bit slots, 32-bit tables and lengths.
    assert md.slot_mapping.dtype == inputs.positions.dtype == torch.long
    assert md.block_tables.dtype == md.seq_lens.dtype == md.query_start_loc.dtype == torch.int32


def test_prompt_chunk_after_a_cached_prefix() -> None:
    """The last 5 tokens of a 13-token prompt whose first 2 blocks (8 tokens) were a cache
    hit: positions continue at 8, not 0, and the KV goes into the 3rd and 4th blocks of
    the table, both entered at their first slot. It completes the prompt: one logits row,
    at its last token."""
    chunk = SequenceChunk([11, 12, 13, 14, 15], start_pos=8, block_ids=[7, 2, 9, 4],
                          num_samples=1)
    check(prepare_inputs([chunk], BLOCK, CPU),
          input_ids=[11, 12, 13, 14, 15],
          positions=[8, 9, 10, 11, 12],
          # positions 8-11: block 9, offsets 0-3; position 12: block 4, offset 0
          slots=[36, 37, 38, 39, 16],
          context_lens=[8], seq_lens=[13], query_start_loc=[0, 5],
          logits_indices=[4], block_tables=[[7, 2, 9, 4]])


def test_decode_inside_a_block() -> None:
    """A decode of a 10-token sequence: the input is its last token, at position 9 (not
    10), written at offset 1 of its 3rd block; it attends over all 10 tokens and is
    sampled."""
    chunk = SequenceChunk([42], start_pos=9, block_ids=[5, 1, 8], num_samples=1)
    check(prepare_inputs([chunk], BLOCK, CPU),
          input_ids=[42], positions=[9], slots=[8 * BLOCK + 1],
          context_lens=[9], seq_lens=[10], query_start_loc=[0, 1],
          logits_indices=[0], block_tables=[[5, 1, 8]])


def test_decode_that_starts_a_new_block() -> None:
    """A decode of a 13-token sequence: position 12 is the first slot of a 4th block, the
    one the scheduler has just added (not one past the end of the 3rd)."""
    chunk = SequenceChunk([42], start_pos=12, block_ids=[5, 1, 8, 3], num_samples=1)
    check(prepare_inputs([chunk], BLOCK, CPU),
          input_ids=[42], positions=[12], slots=[3 * BLOCK + 0],
          context_lens=[12], seq_lens=[13], query_start_loc=[0, 1],
          logits_indices=[0], block_tables=[[5, 1, 8, 3]])


def test_chunk_that_ends_mid_prompt_is_not_sampled() -> None:
    """The first 6 tokens of a longer prompt (chunked prefill): its KV is written, but its
    last token is not the prompt's last, so no logits row is taken for it."""
    chunk = SequenceChunk([1, 2, 3, 4, 5, 6], start_pos=0, block_ids=[6, 3], num_samples=0)
    check(prepare_inputs([chunk], BLOCK, CPU),
          input_ids=[1, 2, 3, 4, 5, 6], positions=[0, 1, 2, 3, 4, 5],
          slots=[24, 25, 26, 27, 12, 13],
          context_lens=[0], seq_lens=[6], query_start_loc=[0, 6],
          logits_indices=[], block_tables=[[6, 3]])


def test_several_requests_in_one_step() -> None:
    """Three requests in one batch, each through its own block table:
    - A, a middle prompt chunk after a one-block hit (positions 4-6, block 0 of the pool,
      which is a valid block like any other), not sampled;
    - B, a decode at the first slot of its 3rd block;
    - C, a whole 5-token prompt whose leader and two forked siblings each sample a first
      token from its last row (three rows at the same index).
    Token indices in the batch: A 0-2, B 3, C 4-8."""
    chunks = [
        SequenceChunk([21, 22, 23], start_pos=4, block_ids=[10, 0], num_samples=0),
        SequenceChunk([31], start_pos=8, block_ids=[3, 5, 11], num_samples=1),
        SequenceChunk([41, 42, 43, 44, 45], start_pos=0, block_ids=[1, 6], num_samples=3),
    ]
    check(prepare_inputs(chunks, BLOCK, CPU),
          input_ids=[21, 22, 23, 31, 41, 42, 43, 44, 45],
          positions=[4, 5, 6, 8, 0, 1, 2, 3, 4],
          slots=[0, 1, 2,  # A: block 0, offsets 0-2
                 44,  # B: block 11, offset 0
                 4, 5, 6, 7, 24],  # C: block 1, offsets 0-3, then block 6, offset 0
          context_lens=[4, 8, 0], seq_lens=[7, 9, 5], query_start_loc=[0, 3, 4, 9],
          logits_indices=[3, 8, 8, 8],
          block_tables=[[10, 0], [3, 5, 11], [1, 6]])


def test_a_block_table_too_short_for_its_tokens_fails_loudly() -> None:
    """The table's padding is block 0, a real block: a table one block short would write
    the last token's KV over whatever block 0 holds, silently."""
    fits = SequenceChunk([1, 2, 3], start_pos=5, block_ids=[7, 2], num_samples=1)
    short = SequenceChunk([1, 2, 3, 4], start_pos=5, block_ids=[7, 2], num_samples=1)
    with pytest.raises(RuntimeError, match="chunk 1 of the step has 2 blocks for 9 tokens, "
                                           "4 to a block"):
        prepare_inputs([fits, short], BLOCK, CPU)
