"""The plain PyTorch reference the Triton attention kernels are checked against (their tests, and
``benchmarks/gpu_check.py`` on a GPU): gather each sequence's context from its blocks, masked
softmax in fp32. ``make_batch`` builds a paged batch with scattered blocks to check them on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

CPU = torch.device("cpu")
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
    device: torch.device = CPU,
) -> Batch:
    """Sequence i has cached[i] tokens already in the cache and new[i] query tokens; decodes
    (new == 1 after cached context) first. Blocks are scattered at random; block 0 unused. The
    values are drawn on the CPU (the same on every device), then moved to ``device``."""
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
    fused, kv_cache = fused.to(device), kv_cache.to(device)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return Batch(
        q=q,
        k=k,
        v=v,
        kv_cache=kv_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=device),
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
    device = batch.q.device
    out = torch.empty(batch.q.shape, dtype=torch.float32, device=device)
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
        query_pos = torch.arange(end - start, device=device)[:, None] + (length - (end - start))
        key_pos = torch.arange(length, device=device)[None, :]
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
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype, device=batch.q.device)
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
    tiles = kernels.prefill_tiles(batch.query_start_loc.tolist(), batch.num_decodes, block_q, batch.q.device)
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
