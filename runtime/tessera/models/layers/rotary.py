"""Rotary position embeddings (rotate-half / NeoX layout, as Hugging Face Llama checkpoints expect).

cos/sin are tabulated once per model for every position, times the RoPE type's attention factor
(as transformers scales them); a forward pass looks its positions up once and every layer
reuses them. Each type's frequencies follow transformers' ``modeling_rope_utils`` operation by
operation, so fp32 tables are bit-identical to transformers' (``tests/models/test_rope_scaling.py``):

- default, linear, llama3, yarn: one set of frequencies for every position;
- dynamic: the frequencies transformers uses for sequences within max_position_embeddings, which is
  where the context stops (``rope_config.context_length``);
- longrope: short_factor's frequencies for positions below original_max_position_embeddings and
  long_factor's from there on. transformers switches a whole sequence to long_factor once it is
  longer than original_max_position_embeddings (its earlier positions too, and a cache written
  before that keeps short ones); a position-indexed table cannot, so past that length the engine
  differs from transformers at the positions below it. Within it, it is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.kernels import native_ops
from tessera.models.rope_config import check_rope_parameters


def _default_frequencies(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear(params: dict[str, Any], dim: int, max_position_embeddings: int) -> torch.Tensor:
    return _default_frequencies(params["rope_theta"], dim) / params["factor"]


def _llama3(params: dict[str, Any], dim: int, max_position_embeddings: int) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly between.
    inv_freq = _default_frequencies(params["rope_theta"], dim)
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic(params: dict[str, Any], dim: int, max_position_embeddings: int) -> torch.Tensor:
    # Dynamic NTK at a sequence of max_position_embeddings tokens (what transformers uses up to it).
    factor, seq_len = params["factor"], max_position_embeddings
    base = params["rope_theta"] * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
        dim / (dim - 2)
    )
    return _default_frequencies(base, dim)


def _yarn_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    factor = params["factor"]
    return (
        factor if factor is not None else max_position_embeddings / params["original_max_position_embeddings"]
    )


def _yarn(params: dict[str, Any], dim: int, max_position_embeddings: int) -> torch.Tensor:
    # YaRN: interpolate (divide by factor) the low frequencies, keep (extrapolate) the high ones,
    # with a linear ramp between the dimensions that turn beta_fast and beta_slow times.
    base = params["rope_theta"]
    factor = _yarn_factor(params, max_position_embeddings)
    original = params["original_max_position_embeddings"]
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _longrope_frequencies(params: dict[str, Any], dim: int, factors: str) -> torch.Tensor:
    ext_factors = torch.tensor(params[factors], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * params["rope_theta"] ** shape)


def _longrope(params: dict[str, Any], dim: int, max_position_embeddings: int) -> torch.Tensor:
    return _longrope_frequencies(params, dim, "short_factor")


def _default(params: dict[str, Any], dim: int, max_position_embeddings: int) -> torch.Tensor:
    return _default_frequencies(params["rope_theta"], dim)


_FREQUENCIES: dict[str, Callable[[dict[str, Any], int, int], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "dynamic": _dynamic,
    "longrope": _longrope,
}


def rope_inverse_frequencies(
    head_dim: int, params: dict[str, Any], max_position_embeddings: int
) -> torch.Tensor:
    """Inverse frequencies for ``params`` (``rope_config.rope_parameters``) at the positions
    below original_max_position_embeddings (longrope's short_factor; the others have one set)."""
    check_rope_parameters(params, head_dim)
    return _FREQUENCIES[params["rope_type"]](params, head_dim, max_position_embeddings)


def _mscale(scale: float, weight: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0


def _yarn_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    factor = _yarn_factor(params, max_position_embeddings)
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(_mscale(factor, params["mscale"]) / _mscale(factor, params["mscale_all_dim"]))
    return _mscale(factor)


def _longrope_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    """What transformers multiplies cos and sin by (yarn's and longrope's attention scaling)."""
    if params["rope_type"] == "yarn":
        return _yarn_attention_factor(params, max_position_embeddings)
    if params["rope_type"] == "longrope":
        return _longrope_attention_factor(params, max_position_embeddings)
    return 1.0


def rope_cos_sin(
    head_dim: int, params: dict[str, Any], max_position_embeddings: int, positions: int
) -> torch.Tensor:
    """[positions, head_dim] fp32: each position's cos (first half) and sin (second half), scaled."""
    inv_freq = rope_inverse_frequencies(head_dim, params, max_position_embeddings)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    if params["rope_type"] == "longrope":  # long_factor's frequencies from the original length on
        original = params["original_max_position_embeddings"]
        long = torch.outer(
            torch.arange(positions, dtype=torch.float32),
            _longrope_frequencies(params, head_dim, "long_factor"),
        )
        freqs[original:] = long[original:]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    scaling = rope_attention_factor(params, max_position_embeddings)
    return cos_sin * scaling if scaling != 1.0 else cos_sin


class RotaryEmbedding(nn.Module):
    """The table for positions [0, max_position) (``max_position_embeddings``: config.json's, which
    some RoPE types read; ``max_position`` where not given)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        dtype: torch.dtype,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        cos_sin = rope_cos_sin(head_dim, params, max_position_embeddings or max_position, max_position)
        # [max_position, head_dim]: cos in the first half, sin in the second; not a checkpoint tensor.
        self.cos_sin: torch.Tensor
        self.register_buffer("cos_sin", cos_sin.to(dtype), persistent=False)

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
