"""Each TP rank's shard, built and loaded in one process, recombines to the unsharded layer.

No process group exists here, so collectives are no-ops and each rank returns its partial
result; the test does the all-gather / all-reduce by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tessera.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tessera.topology import RankPlacement

torch.manual_seed(0)
X = torch.randn(5, 24)


def test_column_parallel_concatenates_to_full() -> None:
    weight, bias = torch.randn(12, 24), torch.randn(12)
    parts = []
    for rank in range(3):
        layer = ColumnParallelLinear(24, 12, bias=True, placement=RankPlacement(tp_rank=rank, tp_size=3))
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        parts.append(layer(X))
    assert torch.allclose(torch.cat(parts, -1), F.linear(X, weight, bias), atol=1e-5)


def test_merged_column_keeps_each_projection_rank_local() -> None:
    gate, up = torch.randn(16, 24), torch.randn(16, 24)
    gates, ups = [], []
    for rank in range(2):
        layer = MergedColumnParallelLinear(24, [16, 16], placement=RankPlacement(tp_rank=rank, tp_size=2))
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        g, u = layer(X).chunk(2, dim=-1)
        gates.append(g)
        ups.append(u)
    assert torch.allclose(torch.cat(gates, -1), X @ gate.T, atol=1e-5)
    assert torch.allclose(torch.cat(ups, -1), X @ up.T, atol=1e-5)


@pytest.mark.parametrize(("tp", "heads", "kv_heads"), [(2, 4, 2), (3, 9, 3), (4, 4, 2), (2, 4, 1)])
def test_qkv_splits_heads_and_replicates_scarce_kv_heads(tp: int, heads: int, kv_heads: int) -> None:
    head_dim = 4
    q_w = torch.randn(heads * head_dim, 24)
    k_w, v_w = torch.randn(kv_heads * head_dim, 24), torch.randn(kv_heads * head_dim, 24)
    full_k = (X @ k_w.T).view(5, kv_heads, head_dim)
    qs = []
    for rank in range(tp):
        layer = QKVParallelLinear(
            24, head_dim, heads, kv_heads, bias=False, placement=RankPlacement(tp_rank=rank, tp_size=tp)
        )
        for shard, w in (("q", q_w), ("k", k_w), ("v", v_w)):
            layer.weight.weight_loader(layer.weight, w, shard)
        q, k, _ = layer(X).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        qs.append(q)
        # This rank's query heads [rank*h, (rank+1)*h) must meet the KV heads they use under GQA.
        local_heads = range(rank * layer.num_heads, (rank + 1) * layer.num_heads)
        needed = sorted({h // (heads // kv_heads) for h in local_heads})
        assert layer.num_kv_heads == len(needed)
        assert torch.allclose(k.view(5, -1, head_dim), full_k[:, needed], atol=1e-5)
    assert torch.allclose(torch.cat(qs, -1), X @ q_w.T, atol=1e-5)


def test_heads_that_do_not_split_name_the_heads_at_fault() -> None:
    with pytest.raises(ValueError, match="3 key/value heads do not split over tensor_parallel_size=4"):
        QKVParallelLinear(24, 2, 12, 3, bias=False, placement=RankPlacement(tp_rank=0, tp_size=4))
    with pytest.raises(ValueError, match="6 attention heads do not split over tensor_parallel_size=4"):
        QKVParallelLinear(24, 4, 6, 2, bias=False, placement=RankPlacement(tp_rank=0, tp_size=4))


def test_row_parallel_partials_sum_to_full_with_bias_once() -> None:
    weight, bias = torch.randn(10, 24), torch.randn(10)
    partial_sum = torch.zeros(5, 10)
    for rank in range(2):
        layer = RowParallelLinear(24, 10, bias=True, placement=RankPlacement(tp_rank=rank, tp_size=2))
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        partial_sum += F.linear(X[:, rank * 12 : (rank + 1) * 12], layer.weight)
    assert torch.allclose(partial_sum + bias, F.linear(X, weight, bias), atol=1e-5)


def test_vocab_parallel_embedding_and_lm_head_recombine() -> None:
    vocab, dim = 100, 8  # not a multiple of the padding: the last rank holds padding rows
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 5, 63, 64, 99, 64 * 1 + 35])
    hidden = torch.randn(3, dim)
    embedded, logits = torch.zeros(len(ids), dim), []
    for rank in range(2):
        embedding = VocabParallelEmbedding(vocab, dim, placement=RankPlacement(tp_rank=rank, tp_size=2))
        embedding.weight.weight_loader(embedding.weight, table)
        embedded += embedding(ids)  # the all-reduce, by hand
        head = ParallelLMHead(vocab, dim, placement=RankPlacement(tp_rank=rank, tp_size=2))
        head.weight.weight_loader(head.weight, table)
        logits.append(F.linear(hidden, head.weight))
    assert torch.allclose(embedded, table[ids])
    assert torch.allclose(torch.cat(logits, -1)[:, :vocab], hidden @ table.T, atol=1e-5)
