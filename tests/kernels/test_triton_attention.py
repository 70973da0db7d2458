"""The Triton attention kernels (run by Triton's interpreter on CPU) against the plain PyTorch
reference (``tessera.kernels.paged_attention_reference``)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tessera.kernels.paged_attention_reference import (
    TOLERANCE,
    Batch,
    make_batch,
    reference_attention,
    reference_write,
    run_kernels,
)
from tests.kernels.triton_interpreter import interpreted_kernels

__all__ = ["interpreted_kernels"]

torch.set_num_threads(2)


def check(
    kernels: ModuleType,
    batch: Batch,
    window: int | None = None,
    softcap: float = 0.0,
    min_partition_size: int = 16,
) -> float:
    scale = batch.head_dim**-0.5
    kv_cache, out = run_kernels(kernels, batch, scale, window, softcap, min_partition_size)
    assert torch.equal(kv_cache, reference_write(batch))
    expected = reference_attention(batch, kv_cache, scale, window, softcap)
    error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
    assert error < TOLERANCE[batch.q.dtype], error
    return error


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_write_is_exact_and_skips_padding(interpreted_kernels: ModuleType, dtype: torch.dtype) -> None:
    batch = make_batch([3, 0], [2, 5], heads=4, kv_heads=2, head_dim=16, dtype=dtype)
    padded = batch.slot_mapping.clone()
    padded[1] = -1  # a padding token: its K/V go nowhere
    kv_cache = batch.kv_cache.clone()
    interpreted_kernels.write_kv_cache(batch.k, batch.v, kv_cache, padded)
    keep = padded >= 0
    expected = batch.kv_cache.clone()
    rows = expected.view(2, -1, batch.kv_heads * batch.head_dim)
    rows[0].index_copy_(0, padded[keep], batch.k[keep])
    rows[1].index_copy_(0, padded[keep], batch.v[keep])
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_split_over_partitions_with_gqa(interpreted_kernels: ModuleType, dtype: torch.dtype) -> None:
    # Contexts of 1 to 53 keys over partitions of 16 or more: some empty for the short ones.
    batch = make_batch([0, 12, 52, 30], [1, 1, 1, 1], heads=8, kv_heads=2, head_dim=32, dtype=dtype)
    batch.num_decodes = 4  # the first (cached 0) decodes its prompt's only token
    assert interpreted_kernels.split_context(53, 4, 2, min_partition_size=16)[0] > 1
    check(interpreted_kernels, batch)


def test_decode_in_one_partition_writes_output_directly(interpreted_kernels: ModuleType) -> None:
    batch = make_batch([9, 20, 3], [1, 1, 1], heads=4, kv_heads=4, head_dim=16, dtype=torch.float32)
    check(interpreted_kernels, batch, min_partition_size=512)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_sliding_window_and_softcap(interpreted_kernels: ModuleType, dtype: torch.dtype) -> None:
    # The window (7) leaves the first partitions of the long contexts with no visible key.
    batch = make_batch([40, 5, 25], [1, 1, 1], heads=6, kv_heads=2, head_dim=32, dtype=dtype)
    check(interpreted_kernels, batch, window=7, softcap=1.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_ragged_prompts_without_cache(interpreted_kernels: ModuleType, dtype: torch.dtype) -> None:
    batch = make_batch([0, 0, 0], [37, 1, 9], heads=4, kv_heads=2, head_dim=32, dtype=dtype)
    check(interpreted_kernels, batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_after_cached_context(interpreted_kernels: ModuleType, dtype: torch.dtype) -> None:
    batch = make_batch([13, 32], [6, 20], heads=8, kv_heads=1, head_dim=32, dtype=dtype)
    check(interpreted_kernels, batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_batch_with_window_and_softcap(interpreted_kernels: ModuleType, dtype: torch.dtype) -> None:
    # Decodes first, then a fresh prompt, a chunk after cached context and a one-token chunk.
    batch = make_batch([17, 33, 0, 11, 8], [1, 1, 23, 9, 1], heads=4, kv_heads=2, head_dim=32, dtype=dtype)
    assert batch.num_decodes == 2
    check(interpreted_kernels, batch, window=10, softcap=2.0)


@pytest.mark.parametrize("head_dim", [96, 256, 8])
def test_head_dims_padded_to_a_power_of_two(interpreted_kernels: ModuleType, head_dim: int) -> None:
    batch = make_batch([10, 0], [1, 7], heads=2, kv_heads=1, head_dim=head_dim, dtype=torch.float32)
    check(interpreted_kernels, batch)


def test_context_split_only_while_the_batch_is_small(interpreted_kernels: ModuleType) -> None:
    split = interpreted_kernels.split_context
    assert split(8192, 2, 8) == (32, 256)  # 16 programs: split to fill the GPU
    assert split(8192, 64, 8) == (2, 4096)  # 512 programs: two partitions are enough
    assert split(8192, 256, 8) == (1, 8192)
    assert split(100, 1, 1) == (1, 256)


def test_unsupported_head_dim_is_named(interpreted_kernels: ModuleType) -> None:
    batch = make_batch([4], [1], heads=1, kv_heads=1, head_dim=512, dtype=torch.float32)
    with pytest.raises(ValueError, match="head_dim 512"):
        check(interpreted_kernels, batch)
