"""Host-side choices shared by the launches: padded sizes, tile sizes, input checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.kernels.triton.attention_tile import INTERPRETED, MAX_HEAD_DIM, NO_WINDOW

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# tl.dot needs every dimension of a tile to be at least 16.
MIN_DOT = 16
# Query rows (tokens x heads of a group) a prefill tile aims for.
PREFILL_ROWS = 64


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class TileShape:
    block_q: int  # query tokens per program
    group_pad: int  # query heads per KV head, padded to a power of two
    head_dim_pad: int
    tile_n: int  # keys per loop step

    @property
    def block_m(self) -> int:
        return self.block_q * self.group_pad


def decode_shape(head_dim: int, group: int) -> TileShape:
    """One query token; the group's heads padded up to a tile tl.dot takes."""
    head_dim_pad = padded_head_dim(head_dim)
    return TileShape(1, max(MIN_DOT, next_power_of_2(group)), head_dim_pad, _tile_n(head_dim_pad))


def prefill_shape(head_dim: int, group: int) -> TileShape:
    head_dim_pad = padded_head_dim(head_dim)
    group_pad = next_power_of_2(group)
    block_q = max(1, PREFILL_ROWS // group_pad)
    return TileShape(block_q, group_pad, head_dim_pad, _tile_n(head_dim_pad))


def padded_head_dim(head_dim: int) -> int:
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} is not supported by the Triton attention kernels (1 to {MAX_HEAD_DIM})"
        )
    # A non-power-of-two head_dim (e.g. 96) is padded and masked: loads of the padding read 0.
    return max(MIN_DOT, next_power_of_2(head_dim))


def _tile_n(head_dim_pad: int) -> int:
    return 32 if head_dim_pad <= 128 else 16


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches get fp32 products: the default (tf32) would round them to 10 mantissa bits.
    return "ieee" if dtype == torch.float32 or dot_upcast(dtype) else "tf32"


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether tile products widen to fp32 first: only under the interpreter, whose dot cannot
    multiply bf16 (the GPU's bf16 products are exact in fp32 too, so the results agree)."""
    return INTERPRETED and dtype == torch.bfloat16


def kernel_window(sliding_window: int | None) -> int:
    if sliding_window is None or sliding_window <= 0:
        return NO_WINDOW
    return sliding_window


def check_attention_inputs(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, head_dim: int) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[-1] != head_dim:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not [2, blocks, block_size, kv_heads, {head_dim}]"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not supported (float16, bfloat16, float32)")
    for name, tensor in (("q", q), ("out", out)):
        if tensor.dtype != kv_cache.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from the cache's {kv_cache.dtype}")
        if tensor.dim() != 2 or tensor.stride(1) != 1:
            raise ValueError(f"{name} must be [tokens, heads * head_dim] with contiguous rows")
