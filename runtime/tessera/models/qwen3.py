"""Qwen3: the Llama layer with an RMSNorm over each query and key head before RoPE.

The norms' weights span one head (``head_dim``), so every tensor-parallel rank holds them whole
and applies them to its own heads.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.models.layers.attention import AttentionPlan
from tessera.models.layers.norm import HeadRMSNorm
from tessera.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tessera.topology import RankPlacement


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, layer: int, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__(config, layer, dtype, placement)
        self.q_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        n = rope.shape[0]
        qkv = self.qkv_proj(hidden_states)[:n]
        heads = qkv.view(n, -1, self.head_dim)
        self.q_norm.normalize_heads_(heads[:, : self.num_heads])
        self.k_norm.normalize_heads_(heads[:, self.num_heads : self.num_heads + self.num_kv_heads])
        return self.attend(qkv, heads, rope, kv_cache, plan)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3DecoderLayer
