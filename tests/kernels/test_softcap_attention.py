"""Soft-capped paged attention (Gemma 2's attn_logit_softcapping): the native kernel's every path
and the ATen fallback against attention written out in plain PyTorch."""

from __future__ import annotations

import pytest
import torch

from tessera import kernels
from tessera.models.layers.attention import Attention, AttentionMetadata, AttentionPlan, GatherWorkspace
from tests.kernels.test_cpu_kernels import mixed_batch, run_both

torch.set_num_threads(2)
CPU = torch.device("cpu")
SOFTCAP = 2.0  # scaled scores here are about N(0, 1): a cap of 2 bends the larger ones

pytestmark = pytest.mark.skipif(kernels.cpu_kernels() is None, reason="no C++ toolchain to build the kernels")


def plain_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    seqs: list[tuple[int, int]],
    scale: float,
    softcap: float,
    window: int | None,
) -> torch.Tensor:
    """Each sequence's queries against its context read from the (written) cache."""
    _, _, block_size, kv_heads, head_dim = cache.shape
    heads = q.shape[1] // head_dim
    keys_values = cache.float().view(2, -1, kv_heads, head_dim)
    out = torch.empty(q.shape[0], heads, head_dim)
    for row, (context, query_len) in enumerate(seqs):
        positions = torch.arange(context)
        slots = metadata.block_tables[row, positions // block_size] * block_size + positions % block_size
        keys, values = keys_values[0, slots], keys_values[1, slots]  # [context, kv_heads, head_dim]
        start = metadata.query_start_loc_list[row]
        queries = q[start : start + query_len].float().view(query_len, heads, head_dim)
        query_pos = torch.arange(context - query_len, context)[:, None]
        visible = positions[None, :] <= query_pos
        if window is not None:
            visible &= positions[None, :] > query_pos - window
        group = heads // kv_heads  # query head h reads KV head h // group
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        scores = torch.tanh(scores / softcap) * softcap
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + query_len] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.view(q.shape[0], heads * head_dim)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window", "dtype"),
    [
        (9, 3, 64, 16, None, torch.float32),  # vector paths: one row at a time and many rows per lane
        (9, 3, 64, 16, 24, torch.float32),  # with a sliding window
        (4, 2, 80, 8, None, torch.float32),  # the generic path (head_dim off the fast path)
        (6, 2, 64, 16, 50, torch.bfloat16),
        (4, 4, 64, 16, None, torch.bfloat16),  # AMX-eligible shape: capped scores take the vector path
    ],
)
def test_softcapped_attention_matches_plain_pytorch(
    monkeypatch: pytest.MonkeyPatch,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
) -> None:
    seqs, metadata, num_blocks = mixed_batch(block_size, seed=heads * head_dim)
    tokens = sum(q for _, q in seqs)
    generator = torch.Generator().manual_seed(0)
    initial_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    capped = Attention(heads, head_dim, kv_heads, sliding_window=window, softcap=SOFTCAP)
    uncapped = Attention(heads, head_dim, kv_heads, sliding_window=window)

    def run(attention: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        cache = initial_cache.clone()
        plan = AttentionPlan.build(metadata, block_size, CPU, GatherWorkspace())
        return attention(q, k, v, cache, plan), cache

    (native, cache), (aten, _) = run_both(monkeypatch, lambda: run(capped))
    expected = plain_attention(q, cache, metadata, seqs, capped.scale, SOFTCAP, window)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for label, got in (("native", native), ("aten", aten)):
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance, msg=label)
    # The cap really bends these scores (guards against a kernel that ignores it).
    plain, _ = run(uncapped)
    assert (plain.float() - expected).abs().max() > 20 * tolerance


def test_a_cap_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="softcap must be positive"):
        Attention(4, 64, 2, softcap=0.0)
