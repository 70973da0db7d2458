"""Write the new tokens' K and V into the paged cache at their slots, both in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTS_PER_PROGRAM = 1024


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_row_stride,
    v_row_stride,
    cache_ptr,  # K of the layer; V starts cache_kv_stride elements later
    cache_kv_stride,
    slot_mapping_ptr,
    row_size,  # kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot is a padding token: nothing to write
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < row_size
        k = tl.load(k_ptr + token.to(tl.int64) * k_row_stride + offsets, mask=mask)
        v = tl.load(v_ptr + token.to(tl.int64) * v_row_stride + offsets, mask=mask)
        destination = cache_ptr + slot * row_size + offsets
        tl.store(destination, k, mask=mask)
        tl.store(destination + cache_kv_stride, v, mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [N, kv_heads * head_dim] (rows may be strided views); kv_cache: [2, blocks,
    block_size, kv_heads, head_dim], contiguous; slot_mapping: [N] int (negative: skip)."""
    row_size = kv_cache.shape[3] * kv_cache.shape[4]
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dim() != 2 or tensor.shape[1] != row_size or tensor.stride(1) != 1:
            raise ValueError(
                f"{name} must be [tokens, {row_size}] with contiguous rows, got {tuple(tensor.shape)}"
            )
        if tensor.dtype != kv_cache.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from the cache's {kv_cache.dtype}")
    tokens = slot_mapping.shape[0]
    if tokens == 0:
        return
    block = min(ELEMENTS_PER_PROGRAM, triton.next_power_of_2(row_size))
    grid = (tokens, triton.cdiv(row_size, block))
    _write_kv_kernel[grid](
        k, v, k.stride(0), v.stride(0), kv_cache, kv_cache.stride(0), slot_mapping, row_size, BLOCK=block
    )
