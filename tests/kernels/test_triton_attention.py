"""The Triton attention kernels (run by Triton's interpreter on CPU) against a plain PyTorch
reference: gather each sequence's context from its blocks, masked softmax in fp32."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from tests.kernels.triton_interpreter import interpreted_kernels

__all__ = ["interpreted_kernels"]

torch.set_num_threads(2)

# Relative to the reference's largest |output|: fp32 to rounding, 16-bit to one rounding of p and
# of the output (the reference reads the same 16-bit cache, so only the kernel's roundings differ).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass
class Batch:
    q: torch.Tensor  # [N, heads * head_dim]
    k: torch.Tensor  # [N, kv_heads * head_dim] (strided views into one fused tensor)
    v: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: int
    heads: int
    kv_heads: int
    head_dim: int


def make_batch(
    cached: list[int],
    new: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 4,
    seed: int = 0,
) -> Batch:
    """Sequence i has cached[i] tokens already in the cache and new[i] query tokens; decodes
    (new == 1 after cached context) first. Blocks are scattered at random; block 0 unused."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    per_seq = [math.ceil(length / block_size) for length in lens]
    num_blocks = 1 + sum(per_seq) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int64)
    cursor = 0
    for i, count in enumerate(per_seq):
        tables[i, :count] = torch.tensor(order[cursor : cursor + count])
        cursor += count
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    slots = [
        int(tables[i, pos // block_size]) * block_size + pos % block_size
        for i in range(len(lens))
        for pos in range(cached[i], lens[i])
    ]
    tokens = len(slots)
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    num_decodes = 0
    while num_decodes < len(new) and new[num_decodes] == 1 and cached[num_decodes] > 0:
        num_decodes += 1
    return Batch(
        q=q,
        k=k,
        v=v,
        kv_cache=kv_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int64),
        num_decodes=num_decodes,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


def reference_write(batch: Batch) -> torch.Tensor:
    expected = batch.kv_cache.clone()
    slots = expected.view(2, -1, batch.kv_heads * batch.head_dim)
    slots[0].index_copy_(0, batch.slot_mapping, batch.k)
    slots[1].index_copy_(0, batch.slot_mapping, batch.v)
    return expected


def reference_attention(
    batch: Batch, kv_cache: torch.Tensor, scale: float, window: int | None, softcap: float
) -> torch.Tensor:
    """[N, heads * head_dim] fp32, from the cache after the write."""
    group = batch.heads // batch.kv_heads
    block_size = kv_cache.shape[2]
    out = torch.empty(batch.q.shape, dtype=torch.float32)
    qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    for i, length in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        blocks = batch.block_tables[i, : math.ceil(length / block_size)]
        context = kv_cache[:, blocks].reshape(2, -1, batch.kv_heads, batch.head_dim)[:, :length].float()
        keys = context[0].repeat_interleave(group, dim=1)
        values = context[1].repeat_interleave(group, dim=1)
        query = batch.q[start:end].float().view(end - start, batch.heads, batch.head_dim)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(end - start)[:, None] + (length - (end - start))
        key_pos = torch.arange(length)[None, :]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).reshape(end - start, -1)
    return out


def run_kernels(
    kernels: ModuleType,
    batch: Batch,
    scale: float,
    window: int | None,
    softcap: float,
    min_partition_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the cache, attend the decodes and the prefills as the model's Triton path does."""
    kv_cache = batch.kv_cache.clone()
    kernels.write_kv_cache(batch.k, batch.v, kv_cache, batch.slot_mapping)
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype)
    lens = batch.seq_lens.tolist()
    kernels.decode_attention(
        out,
        batch.q,
        kv_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.num_decodes,
        max(lens[: batch.num_decodes], default=0),
        scale,
        window,
        softcap,
        min_partition_size=min_partition_size,
    )
    block_q = kernels.prefill_block_q(batch.head_dim, batch.heads // batch.kv_heads)
    tiles = kernels.prefill_tiles(
        batch.query_start_loc.tolist(), batch.num_decodes, block_q, torch.device("cpu")
    )
    kernels.prefill_attention(
        out,
        batch.q,
        kv_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        tiles,
        scale,
        window,
        softcap,
    )
    return kv_cache, out


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
