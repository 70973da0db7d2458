"""A step's inputs: token ids, positions, KV slots and block tables of a mixed batch."""

from __future__ import annotations

import torch

from tessera.wire.sched_output import ScheduledRequest
from tessera.worker.model_runner import step_inputs


def _scheduled(request_id: str, tokens: list[int], start: int, block_ids: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id, token_ids=tokens, start_position=start, block_ids=block_ids, sample=True
    )


def test_slots_follow_each_request_blocks_across_block_boundaries() -> None:
    """Decodes at a block's first and last offsets, and a prompt chunk that starts mid-block and
    spans three of its (non-contiguous) blocks: each token's slot is its block's id times the
    block size plus its offset, and block tables are padded with zeros."""
    block_size = 4
    batch = [
        _scheduled("decode-first-offset", [11], 8, [7, 3, 9]),  # position 8: block 2 (id 9), offset 0
        _scheduled("decode-last-offset", [12], 3, [5]),  # position 3: block 0 (id 5), offset 3
        _scheduled("chunk", [21, 22, 23, 24, 25, 26, 27], 6, [2, 8, 1, 6]),  # positions 6-12
    ]
    input_ids, positions, metadata = step_inputs(batch, block_size, torch.device("cpu"))

    assert input_ids.tolist() == [11, 12, 21, 22, 23, 24, 25, 26, 27]
    assert positions.tolist() == [8, 3, 6, 7, 8, 9, 10, 11, 12]
    decode_slots = [9 * 4 + 0, 5 * 4 + 3]
    chunk_slots = [8 * 4 + 2, 8 * 4 + 3, 1 * 4, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 6 * 4]
    assert metadata.slot_mapping.tolist() == [*decode_slots, *chunk_slots]
    assert metadata.block_tables.tolist() == [[7, 3, 9, 0], [5, 0, 0, 0], [2, 8, 1, 6]]
    assert metadata.query_start_loc_list == [0, 1, 2, 9]
    assert metadata.seq_lens_list == [9, 4, 13]
    assert metadata.num_decodes == 2
    assert metadata.max_seq_len == 13
    assert all(
        t.dtype == torch.int64 for t in (input_ids, positions, metadata.slot_mapping, metadata.block_tables)
    )
