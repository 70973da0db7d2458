"""The attention kernel both launches share: one tile of query rows against its sequence's blocks.

A program takes ``BLOCK_Q`` consecutive query tokens of one sequence and all ``group`` query
heads of one KV head (GQA: the heads sharing a KV head are rows of the same tile, so each
key and value is read once for all of them), and walks the keys it may see straight through
the block table with an online softmax, ``TILE_N`` keys at a time. Visible: key position
``<= query position`` (causal, offset by the cached length), ``> query position - window``,
``< seq_len``. Scores accumulate in fp32 whatever the cache dtype.

With ``SPLIT`` (decode over long contexts) program axis 2 is a partition of the context: the
program stores its unnormalised output, running max and sum for ``combine_partitions`` to
merge; without it the program writes the normalised output.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Positions never come near this: a layer without a sliding window passes it as its window.
NO_WINDOW = 1 << 30
MAX_HEAD_DIM = 256


@triton.jit
def _tanh(x):
    # tanh from exp (no tanh in every Triton version's core language); saturates to +-1, no NaN.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter's dot multiplies bf16 as raw integers: widen (products exact)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def paged_attention_tile(
    q_ptr,
    q_row_stride,
    cache_ptr,  # K of the layer; V starts cache_kv_stride elements later
    cache_kv_stride,
    block_tables_ptr,
    block_table_stride,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seqs_ptr,  # prefill: sequence of each tile
    tile_rows_ptr,  # prefill: first query row of each tile
    out_ptr,
    out_row_stride,
    part_acc_ptr,  # SPLIT: [rows, heads, partitions, HEAD_DIM_PAD] fp32
    part_max_ptr,  # SPLIT: [rows, heads, partitions] fp32
    part_sum_ptr,
    scale,
    softcap,
    window,
    block_size,
    partition_size,
    num_kv_heads,
    group,
    head_dim,
    DECODE: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    if DECODE:  # decodes come first in the batch, one token each: sequence i is row i
        seq = tile
        first_row = tile
    else:
        seq = tl.load(tile_seqs_ptr + tile)
        first_row = tl.load(tile_rows_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - (q_end - q_begin)  # position of the sequence's first query row

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    r = tl.arange(0, BLOCK_M)
    row = first_row + r // GROUP_PAD
    head_in_group = r % GROUP_PAD
    row_valid = (row < q_end) & (head_in_group < group)
    head = kv_head * group + head_in_group
    q_pos = cached + (row - q_begin)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = d < head_dim
    q = tl.load(
        q_ptr + row.to(tl.int64)[:, None] * q_row_stride + head[:, None] * head_dim + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )

    # The keys any row of this tile may see, cut to this program's partition.
    first_pos = cached + (first_row - q_begin)
    last_pos = cached + (tl.minimum(first_row + BLOCK_Q, q_end) - 1 - q_begin)
    key_lo = tl.maximum(first_pos - window + 1, 0)
    key_hi = last_pos + 1
    if SPLIT:
        key_lo = tl.maximum(key_lo, part * partition_size)
        key_hi = tl.minimum(key_hi, (part + 1) * partition_size)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for start in range(key_lo, key_hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        key_valid = pos < key_hi
        block = tl.load(table + pos // block_size, mask=key_valid, other=0)
        slot = block.to(tl.int64) * block_size + pos % block_size
        kv_offset = (slot * num_kv_heads + kv_head) * head_dim
        kv_mask = key_valid[:, None] & d_valid[None, :]
        k = tl.load(cache_ptr + kv_offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale
        if USE_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        visible = (
            key_valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        )
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A row that has seen no key yet keeps max -inf: subtract 0 instead (exp(-inf) = 0, no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        s_sum = s_sum * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + cache_kv_stride + kv_offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m = m_new

    if SPLIT:
        num_heads = num_kv_heads * group
        partial = (row.to(tl.int64) * num_heads + head) * tl.num_programs(2) + part
        tl.store(part_max_ptr + partial, m, mask=row_valid)
        tl.store(part_sum_ptr + partial, s_sum, mask=row_valid)
        tl.store(part_acc_ptr + partial[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=row_valid[:, None])
    else:
        out = acc / tl.where(s_sum > 0, s_sum, 1.0)[:, None]
        tl.store(
            out_ptr + row.to(tl.int64)[:, None] * out_row_stride + head[:, None] * head_dim + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )


# Whether the kernels were decorated for the interpreter (Triton reads TRITON_INTERPRET then).
INTERPRETED: bool = isinstance(paged_attention_tile, InterpretedFunction)
