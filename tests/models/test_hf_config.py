"""Tessera's config.json reader against transformers' config classes: every field the model reads,
and what it derives from them (RoPE frequencies, context length, sliding windows per layer)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.models.hf_config import ARCHITECTURE_FAMILIES, HFConfig, load_hf_config
from tessera.models.layers.rotary import rope_attention_factor, rope_inverse_frequencies
from tessera.models.llama import context_length, rope_parameters, sliding_window_of_layer
from tessera.models.loader import MODEL_CLASSES, UnsupportedModelError, model_class_for
from tessera.models.support import check_supported

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
# Phi-3's longrope factors, one per frequency of a 16-wide head.
SHORT_FACTOR = [1.0 + 0.05 * i for i in range(8)]
LONG_FACTOR = [1.5 + 0.4 * i for i in range(8)]
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
    "llama 3.1 RoPE, a top-level original_max_position_embeddings (it wins)": {
        "model_type": "llama",
        **SMALL,
        "rope_scaling": LLAMA3_ROPE,
        "original_max_position_embeddings": 2048,
    },
    "llama, yarn with every optional field": {
        "model_type": "llama",
        **SMALL,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 0.8,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
    },
    "llama, yarn with mscale and mscale_all_dim (DeepSeek's spelling)": {
        "model_type": "llama",
        **SMALL,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 163840,
    },
    "llama, yarn with mscale alone (ignored) and factor null (max / original)": {
        "model_type": "llama",
        **SMALL,
        "rope_scaling": {
            "type": "yarn",
            "factor": None,
            "original_max_position_embeddings": 512,
            "mscale": 2.0,
        },
        "max_position_embeddings": 2048,
    },
    "qwen2, yarn as Qwen2.5's model card adds it": {
        "model_type": "qwen2",
        **SMALL,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    },
    "llama, rope_parameters and a yarn rope_scaling added (it wins)": {
        "model_type": "llama",
        **SMALL,
        "rope_parameters": {"rope_theta": 1e4},
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    },
    "llama, dynamic NTK": {
        "model_type": "llama",
        **SMALL,
        "rope_scaling": {"type": "dynamic", "factor": 2.0},
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
    "phi3, nothing but its type": {"model_type": "phi3"},
    "phi3, a window on every layer": {"model_type": "phi3", **SMALL, "sliding_window": 16},
    "phi3 128k, longrope (Phi-3's top-level original length)": {
        "model_type": "phi3",
        **SMALL,
        "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR},
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "architectures": ["Phi3ForCausalLM"],
    },
    "phi3, longrope read from 'yarn', factor and attention_factor given": {
        "model_type": "phi3",
        **SMALL,
        "rope_parameters": {
            "rope_type": "yarn",
            "short_factor": SHORT_FACTOR,
            "long_factor": LONG_FACTOR,
            "factor": 8.0,
            "attention_factor": 1.2,
        },
        "max_position_embeddings": 32768,
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
    none, MistralAttention and Phi3Model's mask slide on every layer, Qwen2's and Ministral's
    attention only on the layers config.layer_types marks."""
    layers = range(config.num_hidden_layers)
    if config.model_type == "llama":
        return [None for _ in layers]
    if config.model_type in (
        "mistral",
        "phi3",
        "mixtral",
        "qwen3_moe",
    ):  # every layer (sliding_window None: none)
        return [config.sliding_window for _ in layers]
    return [config.sliding_window if config.layer_types[i] == "sliding_attention" else None for i in layers]


def transformers_rope(config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor as transformers' rotary embedding starts with them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":  # each family's own copy of the same function
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def derived(config: Any, windows: list[int | None], theirs: bool) -> dict[str, Any]:
    """What the model computes from a config, whichever reader made it (its windows: ours, or
    those transformers runs; its RoPE frequencies: ours, or transformers' own)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    params = rope_parameters(config)
    if theirs:
        inverse_frequencies, attention_factor = transformers_rope(config)
    else:
        inverse_frequencies = rope_inverse_frequencies(head_dim, params, config.max_position_embeddings)
        attention_factor = rope_attention_factor(params, config.max_position_embeddings)
    return {
        "rope_type": params["rope_type"],
        "rope_theta": params["rope_theta"],
        "original_max_position_embeddings": params.get("original_max_position_embeddings"),
        "context_length": context_length(config),
        "windows": windows,
        "head_dim": head_dim,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "inverse_frequencies": inverse_frequencies,
        "attention_factor": attention_factor,
    }


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
def test_fields_and_derivations_match_transformers(tmp_path: Path, fields: dict[str, Any]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(fields))
    ours, theirs = load_hf_config(tmp_path), transformers_config(tmp_path)
    for name in FIELDS:
        assert getattr(ours, name, None) == getattr(theirs, name, None), name
    if "quantization_config" not in fields:
        check_supported(ours, tmp_path)
    if "moe" in theirs.model_type or theirs.model_type == "mixtral":
        for name in MOE_FIELDS:
            assert getattr(ours, name, None) == getattr(theirs, name, None), name
    ours_windows = [sliding_window_of_layer(ours, layer) for layer in range(ours.num_hidden_layers)]
    ours_derived, theirs_derived = (
        derived(ours, ours_windows, theirs=False),
        derived(theirs, windows_transformers_runs(theirs), theirs=True),
    )
    torch.testing.assert_close(
        ours_derived.pop("inverse_frequencies"), theirs_derived.pop("inverse_frequencies"), rtol=0, atol=0
    )
    assert ours_derived == theirs_derived
    assert model_class_for(ours) is model_class_for(theirs)


def test_context_length_of_each_scaling() -> None:
    def length(**fields: Any) -> int:
        return context_length(
            HFConfig({"model_type": "llama", **SMALL, "max_position_embeddings": 4096, **fields})
        )

    assert length() == 4096
    assert length(rope_scaling={"type": "linear", "factor": 2.0}) == 8192
    assert length(rope_scaling=LLAMA3_ROPE) == 4096
    assert (
        length(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
        == 16384
    )
    assert length(rope_scaling={"type": "dynamic", "factor": 4.0}) == 4096  # capped: exact only there
    longrope = {"type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}
    assert length(rope_scaling=longrope, original_max_position_embeddings=1024) == 4096


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"rope_scaling": {"type": "foo", "factor": 2.0}},
            "config.json rope_scaling.rope_type 'foo' is not supported "
            "(default, linear, llama3, yarn, dynamic, longrope are)",
        ),
        (
            {"rope_parameters": {"rope_type": "foo", "rope_theta": 1e4}},
            "config.json rope_parameters.rope_type 'foo' is not supported",
        ),
        ({"partial_rotary_factor": 0.75}, "config.json partial_rotary_factor 0.75 is not supported"),
        ({"rope_scaling": {"type": "linear"}}, "config.json rope_scaling.factor is missing"),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4.0, "mrope_section": [2, 3, 3]}},
            "config.json rope_scaling.mrope_section is not supported with rope_type 'yarn'",
        ),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": LONG_FACTOR}},
            "config.json rope_scaling.short_factor has 1 entries, not head_dim / 2 = 8",
        ),
    ],
)
def test_rope_settings_the_engine_does_not_compute_are_refused_by_field(
    fields: dict[str, Any], message: str
) -> None:
    config = HFConfig({"model_type": "llama", **SMALL, **fields})
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        check_supported(config, Path("model"))


def test_phi4_mini_partial_rotary_is_refused(tmp_path: Path) -> None:
    """Phi-4-mini rotates 3/4 of each head; the engine rotates whole heads, so it refuses."""
    fields = {
        "model_type": "phi3",
        **SMALL,
        "partial_rotary_factor": 0.75,
        "architectures": ["Phi3ForCausalLM"],
    }
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        check_supported(HFConfig(fields), tmp_path)


def test_every_architecture_with_defaults_has_a_model_class() -> None:
    assert set(ARCHITECTURE_FAMILIES) == set(MODEL_CLASSES)


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


GEMMA_FIELDS = (
    *FIELDS,
    "hidden_activation",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_bidirectional_attention",
)
GEMMA_SMALL = {**SMALL, "num_key_value_heads": 2, "head_dim": 32}
# Gemma config.json files: Gemma 2's alternating windows, Gemma 3's pattern and both RoPE spellings.
GEMMA_CASES: dict[str, dict[str, Any]] = {
    "gemma2, nothing but its type": {"model_type": "gemma2"},
    "gemma2, small, own softcaps and scalar": {
        "model_type": "gemma2",
        **GEMMA_SMALL,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": None,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "rope_theta": 20000.0,
    },
    "gemma2, layer types given": {
        "model_type": "gemma2",
        **GEMMA_SMALL,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "architectures": ["Gemma2ForCausalLM"],
    },
    "gemma3 text, nothing but its type": {"model_type": "gemma3_text"},
    "gemma3 text, old RoPE spelling with a scaling": {
        "model_type": "gemma3_text",
        **GEMMA_SMALL,
        "num_hidden_layers": 7,
        "rope_theta": 500000.0,
        "rope_local_base_freq": 5000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    },
    "gemma3 text, sliding_window_pattern": {
        "model_type": "gemma3_text",
        **GEMMA_SMALL,
        "sliding_window_pattern": 2,
        "sliding_window": 16,
    },
    "gemma3 text, rope_parameters by layer type": {
        "model_type": "gemma3_text",
        **GEMMA_SMALL,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        "architectures": ["Gemma3ForCausalLM"],
    },
}


def gemma_inverse_frequencies_of_transformers(config: Any) -> dict[str, torch.Tensor]:
    """Each layer type's RoPE inverse frequencies as transformers' own rotary modules compute them."""
    if config.model_type == "gemma2":
        from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding

        inv_freq = Gemma2RotaryEmbedding(config).inv_freq
        return {"full_attention": inv_freq, "sliding_attention": inv_freq}
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rotary = Gemma3RotaryEmbedding(config)
    return {kind: getattr(rotary, f"{kind}_inv_freq") for kind in ("full_attention", "sliding_attention")}


@pytest.mark.parametrize("fields", GEMMA_CASES.values(), ids=GEMMA_CASES.keys())
def test_gemma_fields_windows_and_rope_tables_match_transformers(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    from tessera.models.gemma import gemma_sliding_window
    from tessera.models.rope_config import gemma3_rope_parameters

    (tmp_path / "config.json").write_text(json.dumps(fields))
    ours, theirs = load_hf_config(tmp_path), transformers_config(tmp_path)
    for name in GEMMA_FIELDS:
        assert getattr(ours, name, None) == getattr(theirs, name, None), name
    assert [gemma_sliding_window(ours, layer) for layer in range(ours.num_hidden_layers)] == [
        theirs.sliding_window if kind == "sliding_attention" else None for kind in theirs.layer_types
    ]
    if ours.model_type == "gemma2":
        params = rope_parameters(ours)
        ours_params = {"full_attention": params, "sliding_attention": params}
    else:
        ours_params = gemma3_rope_parameters(ours)
    theirs_frequencies = gemma_inverse_frequencies_of_transformers(theirs)
    for kind, params in ours_params.items():
        frequencies = rope_inverse_frequencies(ours.head_dim, params, ours.max_position_embeddings)
        # transformers folds a linear factor into the frequencies as we do.
        torch.testing.assert_close(frequencies, theirs_frequencies[kind], rtol=0, atol=0)
    assert model_class_for(ours) is model_class_for(theirs)


def test_gemma_family_from_architectures_when_model_type_is_missing() -> None:
    assert HFConfig({"architectures": ["Gemma2ForCausalLM"], **SMALL}).model_type == "gemma2"
    config = HFConfig({"architectures": ["Gemma3ForCausalLM"], **SMALL})
    assert config.model_type == "gemma3_text" and config.layer_types == ["sliding_attention"] * 4
