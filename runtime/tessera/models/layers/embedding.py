"""Token embedding and LM head split over the vocabulary (each TP rank holds a contiguous range)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.distributed.communication import (
    pad_rows,
    padded_rows,
    tp_all_gather,
    tp_all_reduce,
    tp_reduce_scatter,
)
from tessera.kernels.gemm import PackedWeight
from tessera.kernels.gemm_selection import LM_HEAD_ROWS
from tessera.models.layers.linear import linear, pack_weight
from tessera.topology import SINGLE_RANK, RankPlacement

# Padding the vocabulary to a multiple of this (per rank) keeps matmul shapes friendly.
VOCAB_PADDING = 64


def pad_vocab(vocab_size: int, tp_size: int) -> int:
    multiple = VOCAB_PADDING * tp_size
    return (vocab_size + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        placement: RankPlacement = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = placement.tp_rank, placement.tp_size
        # Sequence parallelism: sum the partial embeddings by reduce-scatter, keep a token shard.
        self.scatter_output = placement.shards_tokens
        self.num_embeddings_padded = pad_vocab(num_embeddings, self.tp_size)
        self.per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.per_partition
        self.vocab_end = self.vocab_start + self.per_partition
        self.weight = nn.Parameter(
            torch.empty(self.per_partition, embedding_dim, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"embedding of shape {tuple(loaded.shape)} does not fit vocab {self.num_embeddings}"
            )
        start = min(self.vocab_start, self.num_embeddings)
        end = min(self.vocab_end, self.num_embeddings)
        param.data[: end - start].copy_(loaded[start:end])
        param.data[end - start :].zero_()  # padding rows: never looked up, logits sliced off

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids outside this rank's range embed to zero here and are summed in from their owner.
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        embedded = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        if self.scatter_output:
            return tp_reduce_scatter(pad_rows(embedded, padded_rows(embedded.shape[0], self.tp_size)), dim=0)
        return tp_all_reduce(embedded)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states to vocabulary logits; with tied embeddings it loads the embedding matrix."""

    packed_weight: PackedWeight | None

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        placement: RankPlacement = SINGLE_RANK,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, placement)
        self.packed_weight = None  # set by process_weights_after_loading

    def pack_weights(self) -> None:
        """The fastest GEMM form of the head's weight (a copy: a tied embedding still looks
        rows up in the dense one)."""
        self.packed_weight = pack_weight(self.weight.data, LM_HEAD_ROWS)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The logits are only read (sampled, gathered): their rows may be padded apart.
        logits = linear(hidden_states, self.weight, self.packed_weight, None, may_pad_rows=True)
        logits = tp_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits through compute_logits(), not forward()")
