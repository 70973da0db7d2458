"""Prefill and chunked-prefill attention over a ragged batch, every sequence in one launch.

Sequence i's query rows are [qsl[i], qsl[i+1]); its context is seq_lens[i] tokens, the
earlier ones already cached in its blocks and the new ones just written there, so a fresh
prompt, a chunk after cached context and a prefix-cache hit are the same case: query row t
sits at position seq_len - query_len + t and sees the keys up to it. The launch's grid is a
list of tiles (sequence, first row) of at most ``block_q`` rows each, built once per forward
on the host (``prefill_tiles``) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.kernels.triton.attention_tile import paged_attention_tile
from tessera.kernels.triton.shapes import (
    check_attention_inputs,
    dot_precision,
    dot_upcast,
    kernel_window,
    prefill_shape,
)


@dataclass(frozen=True)
class PrefillTiles:
    block_q: int
    seqs: torch.Tensor  # [tiles] int32: the sequence of each tile
    rows: torch.Tensor  # [tiles] int32: its first query row

    @property
    def count(self) -> int:
        return self.seqs.shape[0]


def prefill_tiles(
    query_start_loc: list[int], first_seq: int, block_q: int, device: torch.device
) -> PrefillTiles:
    """Tiles of sequences [first_seq, B): every block_q query rows of each, none for an empty one."""
    seqs, rows = [], []
    for seq in range(first_seq, len(query_start_loc) - 1):
        for row in range(query_start_loc[seq], query_start_loc[seq + 1], block_q):
            seqs.append(seq)
            rows.append(row)
    table = torch.tensor([seqs, rows], dtype=torch.int32).to(device, non_blocking=True)
    return PrefillTiles(block_q, table[0], table[1])


def prefill_block_q(head_dim: int, group: int) -> int:
    """The tile height ``prefill_tiles`` must use for a layer of this shape."""
    return prefill_shape(head_dim, group).block_q


def prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tiles: PrefillTiles,
    scale: float,
    sliding_window: int | None = None,
    softcap: float = 0.0,
) -> None:
    """Attend the query rows the tiles cover into the same rows of out (shapes as in
    ``decode_attention``); their K/V must already be in the cache."""
    if tiles.count == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    check_attention_inputs(q, out, kv_cache, head_dim)
    heads = q.shape[1] // head_dim
    group = heads // num_kv_heads
    shape = prefill_shape(head_dim, group)
    if tiles.block_q != shape.block_q:
        raise ValueError(
            f"tiles.block_q {tiles.block_q} is not this layer's {shape.block_q} (prefill_block_q)"
        )
    paged_attention_tile[(tiles.count, num_kv_heads, 1)](
        q,
        q.stride(0),
        kv_cache,
        kv_cache.stride(0),
        block_tables,
        block_tables.stride(0),
        seq_lens,
        query_start_loc,
        tiles.seqs,
        tiles.rows,
        out,
        out.stride(0),
        out,  # partials: unused without a split
        out,
        out,
        scale,
        softcap,
        kernel_window(sliding_window),
        block_size,
        0,
        num_kv_heads,
        group,
        head_dim,
        DECODE=False,
        SPLIT=False,
        USE_SOFTCAP=softcap > 0,
        BLOCK_Q=shape.block_q,
        GROUP_PAD=shape.group_pad,
        HEAD_DIM_PAD=shape.head_dim_pad,
        TILE_N=shape.tile_n,
        DOT_PRECISION=dot_precision(kv_cache.dtype),
        DOT_UPCAST=dot_upcast(kv_cache.dtype),
    )
