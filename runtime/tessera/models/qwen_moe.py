"""Qwen2-MoE (Qwen2 attention with q/k/v biases, a sparse MLP beside a sigmoid-gated shared
expert) and Qwen3-MoE (Qwen3's attention with per-head q/k norms, a sparse MLP). Layers listed in
``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense MLP, as in transformers."""

from __future__ import annotations

from typing import Any

from tessera.models.layers.moe import MoeSpec
from tessera.models.qwen3 import Qwen3Attention
from tessera.models.sparse_moe import MoeDecoderLayer, MoeForCausalLM


def qwen_moe_spec(config: Any, shared_intermediate_size: int = 0) -> MoeSpec:
    return MoeSpec(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        weights_in_model_dtype=True,
        shared_intermediate_size=shared_intermediate_size,
    )


def qwen_sparse_layer(config: Any, layer: int) -> bool:
    return (
        layer not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (layer + 1) % config.decoder_sparse_step == 0
    )


class Qwen2MoeDecoderLayer(MoeDecoderLayer):
    sparse_layer = staticmethod(qwen_sparse_layer)

    @staticmethod
    def moe_spec(config: Any) -> MoeSpec:
        return qwen_moe_spec(config, int(config.shared_expert_intermediate_size))


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    attention_class = Qwen3Attention
    sparse_layer = staticmethod(qwen_sparse_layer)

    @staticmethod
    def moe_spec(config: Any) -> MoeSpec:
        return qwen_moe_spec(config)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    decoder_layer_class = Qwen2MoeDecoderLayer


class Qwen3MoeForCausalLM(MoeForCausalLM):
    decoder_layer_class = Qwen3MoeDecoderLayer
