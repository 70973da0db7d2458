"""A checkpoint's ``config.json`` as the model reads it, without importing transformers.

Importing transformers costs about 3.5 s of CPU, and every rank process paid it only to read
this file: a group of 6 ranks sharing 2 cores started some 10 s later for it. Each family
reads a few fields; they are read here with the class defaults and the derived fields of
transformers' own config class of each family (``FAMILY_DEFAULTS``).
``tests/models/test_hf_config.py`` checks every field the model reads against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"


class UnsupportedModelError(ValueError):
    """A model folder the engine cannot run as it is written (the message names the field)."""


_SHARED = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": None,
}
_MISTRAL = {
    **_SHARED,
    "vocab_size": 32000,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "sliding_window": 4096,
}
_QWEN = {
    **_SHARED,
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
}
# model_type -> what transformers' config class assumes for a field config.json leaves out.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_SHARED,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "num_key_value_heads": None,
        "head_dim": None,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {**_MISTRAL, "head_dim": None},
    # What transformers reads a Mistral config with layer_types as (alternating attention); its
    # head_dim stays null (the model divides hidden_size by the heads).
    "ministral": {**_MISTRAL, "layer_types": None},
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    # Phi-3 has no head_dim field (its attention divides hidden_size by the heads); every layer
    # slides when sliding_window is set.
    "phi3": {
        **_SHARED,
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_key_value_heads": None,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "sliding_window": None,
    },
    # Mixtral's head_dim stays null in transformers too (the model divides hidden_size by the heads).
    "mixtral": {
        **_MISTRAL,
        "rope_theta": 1e6,  # its config class's default_theta
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        **_QWEN,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "norm_topk_prob": False,
        "mlp_only_layers": None,
        "qkv_bias": True,
    },
    "qwen3_moe": {
        **_SHARED,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_local_experts": 128,
        "norm_topk_prob": False,
        "mlp_only_layers": None,
    },
}
# Field names transformers reads as others (its config classes' attribute_map): Hub configs of
# Qwen3-MoE say num_experts, transformers saves num_local_experts; the model reads either.
ATTRIBUTE_MAPS: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
}
_GEMMA = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": None,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "layer_types": None,
}
FAMILY_DEFAULTS["gemma2"] = {
    **_GEMMA,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "use_bidirectional_attention": None,
}
FAMILY_DEFAULTS["gemma3_text"] = {
    **_GEMMA,
    "vocab_size": 262208,
    "max_position_embeddings": 131072,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}
# Gemma 3's layers slide except every sliding_window_pattern-th (transformers' default: 6).
GEMMA3_SLIDING_WINDOW_PATTERN = 6

# A config.json without "model_type" still names its family by its architectures.
ARCHITECTURE_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "ministral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def _derive(values: dict[str, Any]) -> None:
    """What transformers' classes compute after loading (their ``__post_init__``)."""
    heads = values.get("num_attention_heads")
    if heads is None:
        return  # not a family this reads; the loader names what it is
    if "num_key_value_heads" in values and values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    if "head_dim" in values and values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // heads
    if values.get("model_type") == "ministral" and values["layer_types"] is None:
        sliding = "sliding_attention" if values["sliding_window"] is not None else "full_attention"
        values["layer_types"] = [sliding] * values["num_hidden_layers"]
    if values.get("model_type") in ("gemma2", "gemma3_text") and values["layer_types"] is None:
        # Gemma 2 alternates sliding and full layers; Gemma 3 makes every pattern-th one full.
        pattern = (
            2
            if values["model_type"] == "gemma2"
            else values.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
        )
        values["layer_types"] = [
            "sliding_attention" if (layer + 1) % pattern else "full_attention"
            for layer in range(values["num_hidden_layers"])
        ]
    if values.get("model_type") == "phi3":
        _phi3_rope_type(values)
    if "mlp_only_layers" in values and values["mlp_only_layers"] is None:
        values["mlp_only_layers"] = []
    if values.get("model_type") == "qwen3_moe" and not values["use_sliding_window"]:
        values["sliding_window"] = None
    if values.get("model_type") == "qwen2_moe":
        # Qwen2-MoE's rule differs from Qwen2's: every other layer below max_window_layers slides.
        values["sliding_window"] = values["sliding_window"] if values["use_sliding_window"] else 0
        if values["layer_types"] is None:
            values["layer_types"] = [
                "sliding_attention"
                if (i + 1) % 2 and i < values["max_window_layers"] and values["use_sliding_window"]
                else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]
    if values.get("model_type") in ("qwen2", "qwen3"):
        # Qwen2 and Qwen3 slide only when asked, on the layers from max_window_layers on.
        window = values["sliding_window"] if values["use_sliding_window"] else None
        values["sliding_window"] = window
        if values["layer_types"] is None:
            values["layer_types"] = [
                "sliding_attention"
                if window is not None and layer >= values["max_window_layers"]
                else "full_attention"
                for layer in range(values["num_hidden_layers"])
            ]


def _phi3_rope_type(values: dict[str, Any]) -> None:
    """Phi-3's config class reads the RoPE types "su" and "yarn" as "longrope" (its only scaling)."""
    for key in ("rope_scaling", "rope_parameters"):
        params = values.get(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) in ("su", "yarn"):
            values[key] = {**params, "rope_type": "longrope"}
            return
        if params:
            return  # the first one given is the one read (see rope_config.rope_parameters)


class HFConfig:
    """config.json's fields as attributes (as transformers keeps unknown keys), over the family's
    defaults, with the fields transformers derives after loading."""

    def __init__(self, fields: dict[str, Any]) -> None:
        model_type = fields.get("model_type")
        if model_type not in FAMILY_DEFAULTS:
            architectures = fields.get("architectures") or []
            model_type = next(
                (ARCHITECTURE_FAMILIES[a] for a in architectures if a in ARCHITECTURE_FAMILIES), None
            )
        if model_type == "mistral" and "layer_types" in fields:
            model_type = "ministral"  # transformers' AutoConfig reads it so
        aliases = ATTRIBUTE_MAPS.get(model_type or "", {})
        fields = {aliases.get(name, name): value for name, value in fields.items()}
        values = {**FAMILY_DEFAULTS.get(model_type or "", {}), **fields}
        values.update({alias: values[name] for alias, name in aliases.items()})
        if model_type is not None:
            values["model_type"] = model_type
        _derive(values)
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        # Only for fields config.json and the defaults lack (and for type checkers: any field).
        raise AttributeError(f"config.json has no {name!r}")

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__!r})"


def load_hf_config(folder: Path) -> HFConfig:
    """The model's configuration from ``folder/config.json``."""
    path = Path(folder) / CONFIG_FILE
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: not a Hugging Face model folder") from None
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path} holds {type(fields).__name__}, not a JSON object")
    return HFConfig(fields)
