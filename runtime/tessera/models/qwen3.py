"""Qwen3: the Llama layer with an RMSNorm over each query and key head before RoPE.

The norms' weights span one head (``head_dim``), so every tensor-parallel rank holds them whole
and applies them to its own heads.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.models.layers.norm import HeadRMSNorm
from tessera.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tessera.topology import RankPlacement


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, layer: int, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__(config, layer, dtype, placement)
        self.q_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps, dtype)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3DecoderLayer
