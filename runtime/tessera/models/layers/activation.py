"""Gated activations on the fused gate_up projection output: SwiGLU, silu(gate) * up, and GeGLU
(Gemma), gelu_tanh(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.kernels import native_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` (gate | up) -> ``[..., I]``."""
    ops = native_ops(x.device)
    if ops is not None and x.dim() == 2 and x.is_contiguous():
        return ops.silu_and_mul(x)
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` (gate | up) -> ``[..., I]`` with GELU's tanh approximation (transformers'
    ``gelu_pytorch_tanh``); no native kernel: ATen's."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
