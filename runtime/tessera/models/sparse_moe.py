"""What the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) share over Llama: decoder
layers whose MLP may be a ``SparseMoeBlock``, and the loading of expert tensors.

Checkpoints store the experts one tensor each (``mlp.experts.N.gate_proj.weight`` ...; Mixtral's
``block_sparse_moe.experts.N.w1/w2/w3``, read under the Qwen names) or, as transformers holds
them in memory, fused over the experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]); both load. Under expert parallelism another rank's expert tensors are never read.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tessera.models.checkpoint import CheckpointTensor
from tessera.models.layers.moe import GroupedExperts, MoeSpec, SparseMoeBlock
from tessera.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tessera.models.support import EXPERTS_FIELDS, check_expert_parallel
from tessera.topology import SINGLE_RANK, RankPlacement

EXPERT_TENSOR = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose MLP is sparse where the family's ``sparse_layer`` says so."""

    @staticmethod
    def moe_spec(config: Any) -> MoeSpec:
        raise NotImplementedError

    @staticmethod
    def sparse_layer(config: Any, layer: int) -> bool:
        return True

    def make_mlp(self, config: Any, layer: int, dtype: torch.dtype, placement: RankPlacement) -> nn.Module:
        if self.sparse_layer(config, layer):
            return SparseMoeBlock(config, self.moe_spec(config), dtype, placement)
        return LlamaMLP(config, dtype, placement)


class MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_class: type[MoeDecoderLayer] = MoeDecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, placement: RankPlacement = SINGLE_RANK) -> None:
        if placement.shards_experts:  # before any weight is read
            experts = self.decoder_layer_class.moe_spec(config).num_experts
            check_expert_parallel(experts, placement.tp_size, EXPERTS_FIELDS[config.model_type])
        super().__init__(config, dtype, placement)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as the parameters spell it (Mixtral renames its own)."""
        return name

    def _place(
        self,
        name: str,
        tensor: torch.Tensor | CheckpointTensor,
        params: dict[str, nn.Parameter],
        loaded: set[str],
        parts: dict[str, set[Any]],
        unplaced: list[str],
    ) -> None:
        name = self.checkpoint_name(name)
        expert = EXPERT_TENSOR.match(name)
        if expert is None:
            super()._place(name, tensor, params, loaded, parts, unplaced)
            return
        if not self._targets(name):
            return  # another stage's layer
        prefix, index, part = expert.group(1), int(expert.group(2)), expert.group(3)
        try:
            experts = self.get_submodule(prefix)
        except AttributeError:
            experts = None
        if not isinstance(experts, GroupedExperts):
            unplaced.append(name)  # a dense layer (or none): the checkpoint is another model's
            return
        if not experts.holds(index):
            return  # another rank's expert: not read
        target = f"{prefix}.{experts.load_expert(index, part, tensor)}"
        parts.setdefault(target, set()).add((index, part))
        if len(parts[target]) == experts.parts(target.rpartition(".")[2]):
            loaded.add(target)
