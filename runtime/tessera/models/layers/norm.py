"""RMSNorm with the residual add fused in (the add is free: the norm reads the sum anyway)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.kernels import native_ops

_NO_RESIDUAL = torch.empty(0)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        # Lower precision: normalise in fp32 and scale after casting back, as the reference does.
        normed = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps).to(x.dtype)
        return normed * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); without a residual, x itself is the residual.

        The native kernel works in place (x becomes the norm, residual the sum): both are
        activations this forward pass owns.
        """
        ops = native_ops(x.device)
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            if residual is None:
                return ops.rms_norm(x, _NO_RESIDUAL, self.weight, self.eps), x
            if residual.is_contiguous():
                return ops.rms_norm(x, residual, self.weight, self.eps), residual
        if residual is not None:
            x = x + residual
        return self._norm(x), x


class HeadRMSNorm(RMSNorm):
    """RMSNorm over each head's ``head_dim`` (Qwen3's and Gemma 3's ``q_norm``/``k_norm``), applied
    in place to a ``[N, heads, head_dim]`` view: the heads inside the fused QKV output."""

    def normalize_heads_(self, heads: torch.Tensor) -> None:
        heads.copy_(self._norm(heads))
