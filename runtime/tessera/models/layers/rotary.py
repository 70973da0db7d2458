"""Rotary position embeddings (rotate-half / NeoX layout, as Hugging Face Llama checkpoints expect).

cos/sin are tabulated once per model for every position; a forward pass looks its positions
up once and every layer reuses them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tessera.kernels import native_ops


def rope_inverse_frequencies(head_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """Inverse frequencies for ``params`` (transformers' ``config.rope_parameters``)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10000.0))
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if dim != head_dim:
        raise NotImplementedError("partial rotary embeddings are not supported")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params, max_position)
    raise NotImplementedError(f"RoPE type {rope_type!r} is not supported (default, linear, llama3 are)")


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any], max_position: int) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly between.
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context = float(params.get("original_max_position_embeddings", max_position))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inverse_frequencies(head_dim, params, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos in the first half, sin in the second; not a checkpoint tensor.
        self.cos_sin: torch.Tensor
        self.register_buffer(
            "cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype), persistent=False
        )

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """[N, head_dim]: each token's cos (first half) and sin (second half)."""
        return self.cos_sin.index_select(0, positions)


def apply_rotary_(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate ``x`` of shape [N, heads, head_dim] in place (rotate-half layout).

    ``x`` may be a view into a wider buffer (Q and K inside the fused QKV output)."""
    ops = native_ops(x.device)
    if ops is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        ops.rotary_embedding(x, cos_sin)
        return
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
