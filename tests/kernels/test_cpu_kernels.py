"""The native CPU kernels against the ATen formulation they replace, op by op, and the packed
GEMM weights against ``F.linear``.

Each case runs both paths on the same inputs (flipping ``tessera.kernels.ENABLED``) and
compares outputs and, for attention, the KV cache written. The attention batch mixes
everything a step can hold: decodes of varied length, fresh prefills, and chunks whose
earlier context is already cached, over deliberately scattered blocks.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tessera import kernels
from tessera.kernels.gemm import MklPackedWeight, OneDnnPackedWeight
from tessera.models.layers.activation import silu_and_mul
from tessera.models.layers.attention import Attention, AttentionMetadata, AttentionPlan, GatherWorkspace
from tessera.models.layers.linear import ColumnParallelLinear, process_weights_after_loading
from tessera.models.layers.norm import RMSNorm
from tessera.models.layers.rotary import RotaryEmbedding, apply_rotary_
from tessera.worker.sampler import greedy

torch.set_num_threads(2)
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(kernels.cpu_kernels() is None, reason="no C++ toolchain to build the kernels")


def run_both(monkeypatch: pytest.MonkeyPatch, fn):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(kernels, "ENABLED", True)
    assert kernels.native_ops(CPU) is not None
    native = fn()
    monkeypatch.setattr(kernels, "ENABLED", False)
    aten = fn()
    return native, aten


def tolerance(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2e-2


def mixed_batch(block_size: int, seed: int) -> tuple[list[tuple[int, int]], AttentionMetadata, int]:
    """(context_len, query_len) per sequence, decodes first, and the step's metadata."""
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 300), 1) for _ in range(9)]
    fresh = [(n, n) for n in (1, 7, 40, 150)]  # 150: many query tiles and blocks on the many-rows path
    chunked = [(ctx, rng.randint(2, 30)) for ctx in (33, 120)]
    seqs = decodes + fresh + chunked
    blocks_needed = [-(-ctx // block_size) for ctx, _ in seqs]
    free = list(range(1, sum(blocks_needed) + 8))
    rng.shuffle(free)
    tables = torch.zeros(len(seqs), max(blocks_needed), dtype=torch.int64)
    slots, query_start, lens = [], [0], []
    for row, ((ctx, q), count) in enumerate(zip(seqs, blocks_needed, strict=True)):
        ids = [free.pop() for _ in range(count)]
        tables[row, :count] = torch.tensor(ids)
        for pos in range(ctx - q, ctx):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
        query_start.append(query_start[-1] + q)
        lens.append(ctx)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(query_start),
        seq_lens=torch.tensor(lens),
        block_tables=tables,
        num_decodes=len(decodes),
        max_seq_len=max(lens),
        query_start_loc_list=query_start,
        seq_lens_list=lens,
    )
    return seqs, metadata, max(max(free, default=0), int(tables.max())) + 1


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window", "dtype"),
    [
        (9, 3, 64, 16, None, torch.float32),  # SmolLM2's shape: the vectorised fp32 path
        (8, 8, 128, 16, None, torch.float32),  # no GQA, head_dim 128
        (9, 3, 64, 16, 24, torch.float32),  # sliding window
        (4, 2, 80, 8, None, torch.float32),  # generic path: head_dim and block size off the fast path
        (6, 2, 64, 16, 50, torch.bfloat16),
        (8, 2, 128, 16, None, torch.bfloat16),  # bf16 on the head_dim-128 fast path
        # bf16 without GQA; on AMX (amx_attention.h) 64 query rows a KV head, and the 150-token
        # prompt's later query tiles take two key blocks (the online rescale between them).
        (4, 4, 64, 16, None, torch.bfloat16),
        # Cache blocks of several key chunks (a chunk is one vector's lanes: 16 keys with AVX-512, 8 with AVX2).
        (9, 3, 64, 32, None, torch.float32),
        (6, 2, 64, 32, 40, torch.bfloat16),
        (4, 4, 64, 8, None, torch.float32),  # a chunk per block with AVX2; the generic path with AVX-512
    ],
)
def test_paged_attention_matches_aten(
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
    # Earlier context (cached keys/values) is random; this step's k/v are written by the layer.
    initial_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    attention = Attention(heads, head_dim, kv_heads, sliding_window=window)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        cache = initial_cache.clone()
        plan = AttentionPlan.build(metadata, block_size, CPU, GatherWorkspace())
        return attention(q, k, v, cache, plan), cache

    (native_out, native_cache), (aten_out, aten_cache) = run_both(monkeypatch, run)
    assert torch.equal(native_cache, aten_cache)
    torch.testing.assert_close(native_out, aten_out, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_aten(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, with_residual: bool
) -> None:
    norm = RMSNorm(96, eps=1e-5, params_dtype=dtype)
    norm.weight.data = torch.rand(96).to(dtype) + 0.5
    x = torch.randn(37, 96).to(dtype)
    residual = torch.randn(37, 96).to(dtype)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        # The kernel works in place: hand it copies.
        normed, summed = norm(x.clone(), residual.clone() if with_residual else None)
        return normed.clone(), summed.clone()

    (native, native_sum), (aten, aten_sum) = run_both(monkeypatch, run)
    torch.testing.assert_close(native_sum, aten_sum, atol=0, rtol=0)
    torch.testing.assert_close(native, aten, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_aten(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    x = (torch.randn(33, 2 * 200) * 6).to(dtype)  # wide range: both signs, saturated sigmoid
    native, aten = run_both(monkeypatch, lambda: silu_and_mul(x))
    torch.testing.assert_close(native, aten, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_aten(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(32, 512, {"rope_type": "default", "rope_theta": 10000.0}, dtype)
    positions = torch.randint(0, 512, (21,))
    qkv = torch.randn(21, (4 + 2 + 2) * 32).to(dtype)

    def run() -> torch.Tensor:
        buffer = qkv.clone()
        # Q and K heads rotated in place inside the fused buffer; V must stay untouched.
        apply_rotary_(buffer.view(21, 8, 32)[:, :6], rope.lookup(positions))
        return buffer

    native, aten = run_both(monkeypatch, run)
    torch.testing.assert_close(native[:, 6 * 32 :], qkv[:, 6 * 32 :], atol=0, rtol=0)
    torch.testing.assert_close(native, aten, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 37, 4096])
def test_greedy_argmax_picks_what_torch_max_picks(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, vocab: int
) -> None:
    """First index of the maximum, ties and all; a row with NaN gives its first NaN; -inf rows 0."""
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    last = vocab - 1
    logits[1, last] = 50.0  # the maximum in the tail after the vector part
    logits[2, [0, last]] = 50.0  # tied: the first wins
    logits[3, [last // 2, last]] = float("nan")
    logits[4] = float("-inf")
    logits[5, last // 3] = float("inf")
    logits[6] = 7.0  # all equal
    logits[7, :: max(1, vocab // 5)] = float("nan")
    native, aten = run_both(monkeypatch, lambda: greedy(logits))
    assert native.dtype == torch.int64
    assert torch.equal(native, aten)
    assert torch.equal(aten, logits.max(dim=-1).indices)


def test_kernel_rejects_mismatched_inputs() -> None:
    ops = kernels.cpu_kernels()
    assert ops is not None
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.silu_and_mul(torch.randn(4, 8).t())
    with pytest.raises(RuntimeError, match="with contiguous rows"):
        ops.greedy_argmax(torch.randn(4, 8).t())
    with pytest.raises(RuntimeError, match="share a dtype"):
        q = torch.randn(1, 64)
        ops.paged_attention(
            torch.empty_like(q), q, torch.randn(1, 64), torch.randn(1, 64),
            torch.zeros(2, 2, 16, 1, 64, dtype=torch.bfloat16), torch.tensor([0]),
            torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1]), torch.tensor([0, 1]), 0.125, 0, 0.0,
        )  # fmt: skip


@pytest.mark.parametrize("packing", ["mkl", "onednn"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_weights_multiply_like_f_linear(packing: str, rows: int, with_bias: bool) -> None:
    ops = kernels.cpu_kernels()
    if packing == "mkl" and not (ops is not None and ops.mkl_packed_gemm_available()):
        pytest.skip("this torch has no MKL packed GEMM")
    if packing == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    packed = MklPackedWeight(weight, ops) if packing == "mkl" else OneDnnPackedWeight(weight)
    x = torch.randn(rows, 80, generator=generator)
    torch.testing.assert_close(packed.matmul(x, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    # Leading dimensions are kept, as F.linear keeps them.
    batched = x.view(1, rows, 80)
    assert packed.matmul(batched, bias).shape == (1, rows, 96)


def test_loaded_linear_layers_are_packed_and_match(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = ColumnParallelLinear(80, 96, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()  # type: ignore[union-attr]
    x = torch.randn(5, 80)
    expected = F.linear(x, layer.weight, layer.bias)
    process_weights_after_loading(layer)
    assert layer.packed_weight is not None
    # A packed copy replaces the dense one; ATen (when measured fastest) keeps it.
    assert (layer.weight.numel() == 0) == (layer.packed_weight.backend != "aten")
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
