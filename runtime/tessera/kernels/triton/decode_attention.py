"""Decode attention: one query token per sequence, split-K over long contexts.

A decode has one query row per head, too little work to fill a GPU over a long context from
one program per (sequence, KV head). The context is cut into partitions attended in
parallel (grid axis 2); ``_combine_partitions`` then merges each head's partial outputs by
their maxima and sums. Only as many partitions as the batch needs to fill the GPU are used
(``split_context``), so a large batch, already parallel enough, keeps one partition and its
programs write the output, skipping the merge and its fp32 workspace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.kernels.triton.attention_tile import paged_attention_tile
from tessera.kernels.triton.shapes import (
    check_attention_inputs,
    decode_shape,
    dot_precision,
    dot_upcast,
    kernel_window,
    next_power_of_2,
)

# Fewest keys per partition: enough that each program amortises its start and the merge.
MIN_PARTITION_SIZE = 256
# Programs worth launching: several per multiprocessor of a large GPU (132 on an H100), so a
# few long decodes still spread over all of them. It also bounds the partials' workspace.
TARGET_PROGRAMS = 1024


@triton.jit
def _combine_partitions(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    out_row_stride,
    num_partitions,
    head_dim,
    PARTITIONS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, PARTITIONS_PAD)
    p_valid = p < num_partitions
    base = (row.to(tl.int64) * tl.num_programs(1) + head) * num_partitions
    maxima = tl.load(part_max_ptr + base + p, mask=p_valid, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + p, mask=p_valid, other=0.0)
    overall = tl.max(maxima, 0)
    # Partitions that saw no key (max -inf, e.g. before a sliding window) weigh 0.
    weights = tl.exp(maxima - tl.where(overall == float("-inf"), 0.0, overall))
    denominator = tl.sum(weights * sums, 0)
    d = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(
        part_acc_ptr + (base + p)[:, None] * HEAD_DIM_PAD + d[None, :], mask=p_valid[:, None], other=0.0
    )
    out = tl.sum(acc * weights[:, None], 0) / denominator
    tl.store(
        out_ptr + row.to(tl.int64) * out_row_stride + head * head_dim + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


def split_context(
    max_seq_len: int, num_decodes: int, num_kv_heads: int, min_partition_size: int = MIN_PARTITION_SIZE
) -> tuple[int, int]:
    """(partitions, keys per partition) for decodes whose longest context is max_seq_len."""
    by_length = triton.cdiv(max_seq_len, min_partition_size)
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, num_decodes * num_kv_heads)
    wanted = max(1, min(by_length, by_occupancy))
    size = triton.cdiv(triton.cdiv(max_seq_len, wanted), min_partition_size) * min_partition_size
    return max(1, triton.cdiv(max_seq_len, size)), size


def decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_decodes: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float = 0.0,
    min_partition_size: int = MIN_PARTITION_SIZE,
) -> None:
    """Attend rows [0, num_decodes) of q (one token of sequence i each) into the same rows of out.

    q, out: [N, heads * head_dim]; kv_cache: [2, blocks, block_size, kv_heads, head_dim];
    block_tables: [B, max_blocks]; seq_lens: [B] (context length including this token);
    query_start_loc: [B + 1]; max_seq_len: the longest decode context (sets the partitions,
    each at least min_partition_size keys);
    softcap > 0: scores become softcap * tanh(score / softcap)."""
    if num_decodes == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    check_attention_inputs(q, out, kv_cache, head_dim)
    heads = q.shape[1] // head_dim
    group = heads // num_kv_heads
    shape = decode_shape(head_dim, group)
    partitions, partition_size = split_context(max_seq_len, num_decodes, num_kv_heads, min_partition_size)
    split = partitions > 1
    if split:
        part_acc = torch.empty(
            num_decodes, heads, partitions, shape.head_dim_pad, dtype=torch.float32, device=q.device
        )
        part_max = torch.empty(num_decodes, heads, partitions, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    paged_attention_tile[(num_decodes, num_kv_heads, partitions)](
        q,
        q.stride(0),
        kv_cache,
        kv_cache.stride(0),
        block_tables,
        block_tables.stride(0),
        seq_lens,
        query_start_loc,
        seq_lens,  # tile maps: unused by decodes
        seq_lens,
        out,
        out.stride(0),
        part_acc,
        part_max,
        part_sum,
        scale,
        softcap,
        kernel_window(sliding_window),
        block_size,
        partition_size,
        num_kv_heads,
        group,
        head_dim,
        DECODE=True,
        SPLIT=split,
        USE_SOFTCAP=softcap > 0,
        BLOCK_Q=1,
        GROUP_PAD=shape.group_pad,
        HEAD_DIM_PAD=shape.head_dim_pad,
        TILE_N=shape.tile_n,
        DOT_PRECISION=dot_precision(kv_cache.dtype),
        DOT_UPCAST=dot_upcast(kv_cache.dtype),
    )
    if split:
        _combine_partitions[(num_decodes, heads)](
            part_acc,
            part_max,
            part_sum,
            out,
            out.stride(0),
            partitions,
            head_dim,
            PARTITIONS_PAD=next_power_of_2(partitions),
            HEAD_DIM_PAD=shape.head_dim_pad,
        )
