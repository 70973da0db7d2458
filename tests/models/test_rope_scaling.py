"""The RoPE tables (cos and sin times the attention factor) against transformers' rotary
embeddings at every position of the table, bit for bit in fp32: where each scaling is exact,
and what longrope does past its original length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.models.hf_config import load_hf_config
from tessera.models.layers.rotary import RotaryEmbedding
from tessera.models.llama import context_length, rope_parameters

HEAD_DIM = 16
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96}
SHORT_FACTOR = [1.0 + 0.3 * i for i in range(HEAD_DIM // 2)]
LONG_FACTOR = [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]
LONGROPE = {
    "model_type": "phi3",
    **SMALL,
    "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR},
    "max_position_embeddings": 256,
    "original_max_position_embeddings": 64,
}
CASES: dict[str, dict[str, Any]] = {
    "linear": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "yarn": {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    "yarn, every field": {
        "rope_scaling": {
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 8.0,
            "beta_slow": 0.5,
            "mscale": 0.9,
            "mscale_all_dim": 0.4,
            "truncate": False,
        }
    },
    "dynamic": {"rope_scaling": {"type": "dynamic", "factor": 3.0}},
}


def tables(tmp_path: Path, fields: dict[str, Any], positions: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Ours ([positions, head_dim], cos then sin) and transformers' for one sequence of
    ``positions`` tokens (their cos and sin repeat each half: the first halves are the table)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(fields))
    ours_config, config = load_hf_config(tmp_path), AutoConfig.from_pretrained(tmp_path)
    rotary_module = __import__(AutoModelForCausalLM._model_mapping[type(config)].__module__, fromlist=["_"])
    rotary_class = next(
        getattr(rotary_module, n) for n in dir(rotary_module) if n.endswith("RotaryEmbedding")
    )
    cos, sin = rotary_class(config)(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    theirs = torch.cat([cos[0, :, : HEAD_DIM // 2], sin[0, :, : HEAD_DIM // 2]], dim=-1)
    ours = RotaryEmbedding(
        HEAD_DIM,
        context_length(ours_config),
        rope_parameters(ours_config),
        torch.float32,
        max_position_embeddings=ours_config.max_position_embeddings,
    ).cos_sin
    return ours, theirs, ours_config


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
def test_each_scaling_equals_transformers_over_the_whole_context(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    config = {"model_type": "llama", **SMALL, "max_position_embeddings": 128, **fields}
    ours, _, ours_config = tables(tmp_path, config, 1)
    length = context_length(ours_config)
    ours, theirs, _ = tables(tmp_path, config, length)
    assert ours.shape == theirs.shape == (length, HEAD_DIM)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    if "dynamic" in str(fields):
        assert length == 128  # transformers' frequencies change past it: the context stops there


def test_yarn_scales_cos_and_sin_by_its_attention_factor(tmp_path: Path) -> None:
    config = {"model_type": "llama", **SMALL, **CASES["yarn"]}
    ours, _, _ = tables(tmp_path, config, 1)
    magnitude = ours[:, : HEAD_DIM // 2].square() + ours[:, HEAD_DIM // 2 :].square()
    # 0.1 * ln(4) + 1: cos^2 + sin^2 is its square.
    torch.testing.assert_close(
        magnitude, torch.full_like(magnitude, (0.1 * torch.tensor(4.0).log() + 1) ** 2)
    )


def test_longrope_takes_short_factor_below_its_original_length_and_long_factor_from_there(
    tmp_path: Path,
) -> None:
    """Within original_max_position_embeddings (64) transformers uses short_factor, and so does
    every row of the table there; a sequence longer than that takes long_factor in
    transformers at all its positions, the table only from position 64 on (see rotary.py)."""
    ours, theirs_short, config = tables(tmp_path, LONGROPE, 64)
    assert context_length(config) == 256
    torch.testing.assert_close(ours[:64], theirs_short, rtol=0, atol=0)
    _, theirs_long, _ = tables(tmp_path, LONGROPE, 256)
    torch.testing.assert_close(ours[64:], theirs_long[64:], rtol=0, atol=0)
    assert (ours[:64] - theirs_long[:64]).abs().max() > 1e-3  # the rows transformers would recompute
