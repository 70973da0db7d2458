"""A model's decoder layers as one native call per forward pass (CPU, tensor-parallel size 1).

``build_decoder_stack`` describes the loaded, packed layers to ``DecoderStack``
(``kernels/csrc/decoder_stack.h``): each linear layer's GEMM as the native kernel its packed
weight belongs to, or the layer's own Python ``forward`` where its backend has no native entry
point (oneDNN, ATen, fp32 compute of bf16 weights). The stack runs the kernels the Python layers
run, in the same order, so its outputs are theirs bit for bit, without the Python between
kernels (module calls, views, dispatch), during which the other OpenMP threads waited.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from tessera.kernels import native_ops
from tessera.kernels.gemm import AmxPackedWeight, MklPackedWeight, NativePackedWeight, PanelPackedWeight
from tessera.models.layers.linear import LinearBase, SiluGatedLinear
from tessera.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_NONE = torch.empty(0)
# Packed weight type -> the native GEMM that multiplies it.
_NATIVE_GEMMS: dict[type[NativePackedWeight], str] = {
    MklPackedWeight: "MKL",
    PanelPackedWeight: "PANELS",
    AmxPackedWeight: "AMX",
}
_GATED_GEMMS = {"panels": "PANELS_GATED", "amx": "AMX_GATED"}


def _linear(ops: ModuleType, layer: LinearBase, silu_after: bool = False) -> Any:
    """How ``layer`` multiplies (``silu_after``: SwiGLU on a plain GEMM's output, as SiluGatedLinear does)."""
    packed = layer.packed_weight
    if isinstance(packed, NativePackedWeight) and type(packed) in _NATIVE_GEMMS:
        gemm = getattr(ops.StackGemm, _NATIVE_GEMMS[type(packed)])
        bias = _NONE if layer.bias is None else layer.bias
        return ops.StackLinear(gemm, packed.data, packed.out_features, bias, None, silu_after)
    # Its own forward, which applies SwiGLU itself where it should.
    return ops.StackLinear(ops.StackGemm.PYTHON, _NONE, 0, _NONE, layer.forward, False)


def _gate_up(ops: ModuleType, layer: SiluGatedLinear) -> Any:
    gated = layer.gated_weight
    if gated is None:
        return _linear(ops, layer, silu_after=True)
    return ops.StackLinear(
        getattr(ops.StackGemm, _GATED_GEMMS[gated.backend]), gated.data, gated.width, _NONE, None, False
    )


def build_decoder_stack(model: LlamaForCausalLM) -> Any | None:
    """The native stack of ``model``'s local decoder layers, or None where it does not apply: no
    native kernels, another device, tensor parallelism (whose collectives run in Python)."""
    layers = model._local_layers()
    # The native stack is the Llama layer exactly: a family whose layer differs (norms on
    # queries and keys, other activations, experts) runs its own modules.
    if any(
        (type(layer), type(layer.self_attn), type(layer.mlp)) != (LlamaDecoderLayer, LlamaAttention, LlamaMLP)
        for layer in layers
    ):
        return None
    device = layers[0].input_layernorm.weight.device
    ops = native_ops(device)
    if ops is None or model.tp_size != 1:
        return None
    described = []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        described.append(
            ops.StackLayer(
                input_norm=layer.input_layernorm.weight,
                input_eps=layer.input_layernorm.eps,
                post_norm=layer.post_attention_layernorm.weight,
                post_eps=layer.post_attention_layernorm.eps,
                qkv=_linear(ops, attention.qkv_proj),
                o=_linear(ops, attention.o_proj),
                gate_up=_gate_up(ops, mlp.gate_up_proj),
                down=_linear(ops, mlp.down_proj),
                heads=attention.num_heads,
                kv_heads=attention.num_kv_heads,
                head_dim=attention.head_dim,
                scale=attention.attn.scale,
                sliding_window=attention.attn.sliding_window or 0,
            )
        )
    return ops.DecoderStack(described)
