"""Gemma 2 and Gemma 3 (text) on the Llama machinery: paged KV cache, TP (and SP) and PP.

What differs from Llama, as transformers' ``modeling_gemma2`` / ``modeling_gemma3`` compute it:

- the embedding is scaled by sqrt(hidden_size), that factor rounded to the model dtype;
- RMSNorm scales by ``1 + weight`` in fp32: the 1 is folded into the weight at load, so the plain
  RMSNorm (and its native kernel) computes it;
- four norms a layer: the attention's and the MLP's outputs are normed before their residual add;
- a GeGLU MLP (``gelu_pytorch_tanh``);
- attention scaled by ``query_pre_attn_scalar ** -0.5``, sliding-window layers among full ones
  (``layer_types``), Gemma 2's tanh soft-capping of attention scores and of the final logits;
- Gemma 3: per-head RMSNorm of queries and keys, and two RoPE tables: sliding layers rotate by
  ``rope_parameters["sliding_attention"]`` (rope_local_base_freq), full ones by
  ``rope_parameters["full_attention"]`` (rope_theta and its scaling).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from tessera.models.checkpoint import CheckpointTensor, materialize
from tessera.models.layers.attention import Attention, AttentionPlan
from tessera.models.layers.linear import GeluTanhGatedLinear, RowParallelLinear, copy_checked
from tessera.models.layers.norm import HeadRMSNorm, RMSNorm
from tessera.models.layers.rotary import RotaryEmbedding
from tessera.models.llama import LlamaAttention, LlamaForCausalLM
from tessera.models.rope_config import FULL, SLIDING, gemma3_rope_parameters
from tessera.topology import SINGLE_RANK, RankPlacement

HIDDEN_ACTIVATION = "gelu_pytorch_tanh"


def _positive_or_none(config: Any, field: str) -> float | None:
    value = getattr(config, field, None)
    if value is None:
        return None
    if not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"config.json {field} {value!r} is not supported (a positive number, or null)")
    return float(value)


def check_gemma_config(config: Any) -> None:
    """Refuse what this implementation does not compute as transformers does, naming the field."""
    activation = getattr(config, "hidden_activation", None)
    if activation != HIDDEN_ACTIVATION:
        raise ValueError(
            f"config.json hidden_activation {activation!r} is not supported ({HIDDEN_ACTIVATION} is)"
        )
    if getattr(config, "use_bidirectional_attention", None):
        raise ValueError("config.json use_bidirectional_attention is not supported (causal attention only)")
    layer_types = list(config.layer_types)
    if len(layer_types) != config.num_hidden_layers or set(layer_types) - {SLIDING, FULL}:
        raise ValueError(
            f"config.json layer_types {layer_types!r} is not supported: one of {SLIDING!r}, {FULL!r} per layer"
        )
    window = getattr(config, "sliding_window", None)
    if SLIDING in layer_types and not (isinstance(window, int) and window > 0):
        raise ValueError(
            f"config.json sliding_window {window!r} is not supported with sliding_attention layers (a positive integer)"
        )
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        _positive_or_none(config, field)
    if _positive_or_none(config, "query_pre_attn_scalar") is None:
        raise ValueError("config.json query_pre_attn_scalar is null: Gemma scales attention by it")


def gemma_sliding_window(config: Any, layer: int) -> int | None:
    """``layer``'s window as transformers' Gemma attention applies it: config.sliding_window on the
    layers layer_types marks sliding (a key is seen from ``window - 1`` positions back)."""
    return int(config.sliding_window) if config.layer_types[layer] == SLIDING else None


Norm = TypeVar("Norm", bound=RMSNorm)


def fold_unit_offset(norm: Norm) -> Norm:
    """Gemma's RMSNorm scales by ``1 + weight``: load ``1 + weight`` (added in fp32, rounded once),
    so ``norm`` computes it as it is."""

    def load(param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor) -> None:
        copy_checked(param.data, materialize(loaded).float() + 1.0)

    norm.weight.weight_loader = load  # type: ignore[attr-defined]
    return norm


class Gemma2Attention(LlamaAttention):
    # Gemma 3's attention caps no scores, whatever config.json says (transformers' Gemma3Attention
    # never passes attn_logit_softcapping on).
    caps_scores = True

    def __init__(self, config: Any, layer: int, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__(config, layer, dtype, placement)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=gemma_sliding_window(config, layer),
            softcap=_positive_or_none(config, "attn_logit_softcapping") if self.caps_scores else None,
        )


class Gemma3Attention(Gemma2Attention):
    caps_scores = False

    def __init__(self, config: Any, layer: int, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__(config, layer, dtype, placement)
        self.q_norm = fold_unit_offset(HeadRMSNorm(self.head_dim, config.rms_norm_eps, dtype))
        self.k_norm = fold_unit_offset(HeadRMSNorm(self.head_dim, config.rms_norm_eps, dtype))


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = GeluTanhGatedLinear(
            config.hidden_size, [inter, inter], params_dtype=dtype, placement=placement
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, params_dtype=dtype, placement=placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class Gemma2DecoderLayer(nn.Module):
    """residual + post_norm(attn(input_norm(h))), then residual + post_ff_norm(mlp(pre_ff_norm(h))).

    As Llama's layer, it returns (x, residual) whose sum is the layer's output: the next fused
    norm adds them. The post-norms take no residual; the pre-norms add it."""

    attention_class: type[Gemma2Attention] = Gemma2Attention

    def __init__(self, config: Any, layer: int, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer, dtype, placement)
        self.mlp = GemmaMLP(config, dtype, placement)

        def norm() -> RMSNorm:
            return fold_unit_offset(RMSNorm(config.hidden_size, config.rms_norm_eps, dtype))

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, rope, kv_cache, plan)
        hidden_states, _ = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        hidden_states, _ = self.post_feedforward_layernorm(hidden_states)
        return hidden_states, residual


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Gemma2DecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, placement: RankPlacement = SINGLE_RANK) -> None:
        check_gemma_config(config)
        super().__init__(config, dtype, placement)
        if self.model.norm is not None:
            fold_unit_offset(self.model.norm)
        self.final_softcap = _positive_or_none(config, "final_logit_softcapping")
        # transformers: a float32 tensor of sqrt(hidden_size), cast to the embedding's dtype.
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5).to(dtype), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_layer_class = Gemma3DecoderLayer

    def build_rotary(self, config: Any, dtype: torch.dtype) -> nn.Module:
        params = gemma3_rope_parameters(config)
        return nn.ModuleDict(
            {
                kind: RotaryEmbedding(self._head_dim, self.max_context, params[kind], dtype)
                for kind in (FULL, SLIDING)
            }
        )

    def layer_ropes(self, positions: torch.Tensor) -> list[torch.Tensor]:
        assert isinstance(self.rotary, nn.ModuleDict)
        rows = {}
        for kind, table in self.rotary.items():
            assert isinstance(table, RotaryEmbedding)
            rows[kind] = table.lookup(positions)
        start, end = self.layer_range
        return [rows[self.config.layer_types[layer]] for layer in range(start, end)]
