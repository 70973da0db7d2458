"""Mixtral: Llama attention (every layer sliding when config.json sets sliding_window, as
Mistral's) with a sparse MLP on every layer: top-k of ``num_local_experts``, always renormalised."""

from __future__ import annotations

from typing import Any

from tessera.models.layers.moe import MoeSpec
from tessera.models.sparse_moe import MoeDecoderLayer, MoeForCausalLM

# Mixtral's checkpoint names -> the parameters' (Qwen-MoE's, transformers' in-memory ones).
_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


class MixtralDecoderLayer(MoeDecoderLayer):
    @staticmethod
    def moe_spec(config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            weights_in_model_dtype=False,
            intermediate_field="intermediate_size",
        )


class MixtralForCausalLM(MoeForCausalLM):
    decoder_layer_class = MixtralDecoderLayer

    def checkpoint_name(self, name: str) -> str:
        if ".block_sparse_moe." not in name:
            return name
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name
