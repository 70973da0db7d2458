"""SwiGLU: silu(gate) * up on the fused gate_up projection output."""

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
