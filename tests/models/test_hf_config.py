"""Tessera's config.json reader against transformers' config classes: every field the model reads,
and what it derives from them (RoPE frequencies, context length, sliding windows per layer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.models.hf_config import HFConfig, load_hf_config
from tessera.models.layers.rotary import rope_inverse_frequencies
from tessera.models.llama import context_length, rope_parameters, sliding_window_of_layer
from tessera.models.loader import UnsupportedModelError, model_class_for

FIELDS = (
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "max_position_embeddings",
    "quantization_config",
)
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 96}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# config.json files as people write them: most leave fields out, older ones spell RoPE the old way.
CASES: dict[str, dict[str, Any]] = {
    "llama, nothing but its type": {"model_type": "llama"},
    "llama, GQA": {"model_type": "llama", **SMALL, "num_key_value_heads": 2, "vocab_size": 128},
    "llama, linear RoPE (old spelling)": {
        "model_type": "llama",
        **SMALL,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "rope_theta": 500000.0,
    },
    "llama 3.1 RoPE (old spelling)": {
        "model_type": "llama",
        **SMALL,
        "rope_scaling": LLAMA3_ROPE,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
    },
    "llama, rope_parameters": {"model_type": "llama", **SMALL, "rope_parameters": {"rope_theta": 1e6}},
    "llama, head_dim, biases, tied": {
        "model_type": "llama",
        **SMALL,
        "head_dim": 32,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
        "architectures": ["LlamaForCausalLM"],
    },
    "llama, quantized": {"model_type": "llama", **SMALL, "quantization_config": {"quant_method": "gptq"}},
    "mistral, nothing but its type": {"model_type": "mistral"},
    "mistral, no window": {"model_type": "mistral", **SMALL, "sliding_window": None},
    "llama, kv heads and head_dim null": {
        "model_type": "llama",
        **SMALL,
        "num_key_value_heads": None,
        "head_dim": None,
    },
    "llama, a sliding_window its attention ignores": {"model_type": "llama", **SMALL, "sliding_window": 8},
    "llamafied qwen2, window off": {
        "model_type": "llama",
        **SMALL,
        "sliding_window": 8,
        "use_sliding_window": False,
    },
    "mistral with layer_types (read as ministral)": {
        "model_type": "mistral",
        **SMALL,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention"] * 2,
        "architectures": ["MistralForCausalLM"],
    },
    "ministral, layer types left out": {"model_type": "ministral", **SMALL, "sliding_window": 8},
    "llama, rope_parameters and a rope_scaling added (it wins, theta and all)": {
        "model_type": "llama",
        **SMALL,
        "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    "qwen2, nothing but its type": {"model_type": "qwen2"},
    "qwen2, window not used": {"model_type": "qwen2", **SMALL, "sliding_window": 32},
    "qwen2, window on the upper layers": {
        "model_type": "qwen2",
        **SMALL,
        "use_sliding_window": True,
        "sliding_window": 32,
        "max_window_layers": 2,
    },
    "qwen2, layer types given": {
        "model_type": "qwen2",
        **SMALL,
        "use_sliding_window": True,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "qwen3, nothing but its type": {"model_type": "qwen3"},
    "qwen3, window on the upper layers, head_dim": {
        "model_type": "qwen3",
        **SMALL,
        "head_dim": 32,
        "use_sliding_window": True,
        "sliding_window": 32,
        "max_window_layers": 2,
        "architectures": ["Qwen3ForCausalLM"],
    },
    "mixtral, nothing but its type": {"model_type": "mixtral"},
    "mixtral, window, experts spelled num_experts": {
        "model_type": "mixtral",
        **SMALL,
        "sliding_window": 32,
        "num_experts": 4,
        "architectures": ["MixtralForCausalLM"],
    },
    "qwen2_moe, nothing but its type": {"model_type": "qwen2_moe"},
    "qwen2_moe, window on every other lower layer, dense layers": {
        "model_type": "qwen2_moe",
        **SMALL,
        "use_sliding_window": True,
        "sliding_window": 32,
        "max_window_layers": 3,
        "mlp_only_layers": [0, 2],
        "decoder_sparse_step": 2,
        "norm_topk_prob": True,
        "qkv_bias": False,
    },
    "qwen3_moe, nothing but its type": {"model_type": "qwen3_moe"},
    "qwen3_moe, Hub spelling num_experts, window": {
        "model_type": "qwen3_moe",
        **SMALL,
        "num_experts": 16,
        "use_sliding_window": True,
        "sliding_window": 32,
        "architectures": ["Qwen3MoeForCausalLM"],
    },
    "qwen3_moe, as transformers saves it": {"model_type": "qwen3_moe", **SMALL, "num_local_experts": 6},
}
# What the MoE families read beyond FIELDS (their experts; every name either spelling gives).
MOE_FIELDS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "qkv_bias",
)


def transformers_config(folder: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def windows_transformers_runs(config: Any) -> list[int | None]:
    """Each layer's attention window as transformers' model code applies it: LlamaAttention has
    none, MistralAttention passes config.sliding_window on every layer, Qwen2's and Ministral's
    attention only on the layers config.layer_types marks."""
    layers = range(config.num_hidden_layers)
    if config.model_type == "llama":
        return [None for _ in layers]
    if config.model_type in ("mistral", "mixtral", "qwen3_moe"):  # every layer (sliding_window None: none)
        return [config.sliding_window for _ in layers]
    return [config.sliding_window if config.layer_types[i] == "sliding_attention" else None for i in layers]


def derived(config: Any, windows: list[int | None]) -> dict[str, Any]:
    """What the model computes from a config, whichever reader made it (its windows: ours, or
    those transformers runs)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    params = rope_parameters(config)
    return {
        "rope_type": params["rope_type"],
        "rope_theta": params["rope_theta"],
        "context_length": context_length(config),
        "windows": windows,
        "head_dim": head_dim,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "inverse_frequencies": rope_inverse_frequencies(head_dim, params, context_length(config)),
    }


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
def test_fields_and_derivations_match_transformers(tmp_path: Path, fields: dict[str, Any]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(fields))
    ours, theirs = load_hf_config(tmp_path), transformers_config(tmp_path)
    for name in FIELDS:
        assert getattr(ours, name, None) == getattr(theirs, name, None), name
    if "moe" in theirs.model_type or theirs.model_type == "mixtral":
        for name in MOE_FIELDS:
            assert getattr(ours, name, None) == getattr(theirs, name, None), name
    ours_windows = [sliding_window_of_layer(ours, layer) for layer in range(ours.num_hidden_layers)]
    ours_derived, theirs_derived = (
        derived(ours, ours_windows),
        derived(theirs, windows_transformers_runs(theirs)),
    )
    torch.testing.assert_close(
        ours_derived.pop("inverse_frequencies"), theirs_derived.pop("inverse_frequencies"), rtol=0, atol=0
    )
    assert ours_derived == theirs_derived
    assert model_class_for(ours) is model_class_for(theirs)


def test_a_scaling_tessera_does_not_run_is_refused_however_the_config_spells_it(tmp_path: Path) -> None:
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    for spelling in ({"rope_scaling": yarn}, {"rope_parameters": {"rope_theta": 1e4}, "rope_scaling": yarn}):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **SMALL, **spelling}))
        config = load_hf_config(tmp_path)
        assert rope_parameters(config)["rope_type"] == "yarn"
        with pytest.raises(NotImplementedError, match="'yarn' is not supported"):
            rope_inverse_frequencies(16, rope_parameters(config), context_length(config))


def test_saved_checkpoints_read_as_transformers_reads_them(tiny_qwen2_dir: Path, smollm2_dir: Path) -> None:
    for folder in (tiny_qwen2_dir, smollm2_dir):
        ours, theirs = load_hf_config(folder), transformers_config(folder)
        assert {name: getattr(ours, name, None) for name in FIELDS} == {
            name: getattr(theirs, name, None) for name in FIELDS
        }
        assert rope_parameters(ours) == rope_parameters(theirs)


def test_family_from_architectures_when_model_type_is_missing() -> None:
    config = HFConfig({"architectures": ["MistralForCausalLM"], **SMALL})
    assert (
        config.model_type == "mistral" and config.sliding_window == 4096 and config.num_key_value_heads == 8
    )


def test_an_unsupported_family_is_named_by_the_loader() -> None:
    config = HFConfig({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2})
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        model_class_for(config)


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "config.json is missing"), ("{", "not valid JSON"), ("[1]", "holds list, not a JSON object")],
)
def test_a_broken_config_file_is_named(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises((FileNotFoundError, ValueError), match=message):
        load_hf_config(tmp_path)
