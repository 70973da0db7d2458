"""Whether the engine runs a model folder, from its config.json alone (no torch, no weights).

``tessera serve`` asks before it starts the engine core or any rank process, so a model it
cannot run (or cannot split as asked) fails at once with a message naming the field;
``load_model`` asks the same on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.models.hf_config import ARCHITECTURE_FAMILIES, HFConfig, UnsupportedModelError, load_hf_config
from tessera.models.rope_config import check_rope, context_length
from tessera.topology import ParallelLayout

# model_type -> the config.json field that counts a mixture-of-experts family's routed experts.
EXPERTS_FIELDS = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts"}

# A config.json without "architectures" still names its family.
MODEL_TYPES = {family: architecture for architecture, family in ARCHITECTURE_FAMILIES.items()}


def supported_architecture(config: HFConfig) -> str:
    """The first of config.json's architectures the engine implements (loader.MODEL_CLASSES has
    a class for each of ARCHITECTURE_FAMILIES)."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures and getattr(config, "model_type", None) in MODEL_TYPES:
        architectures = [MODEL_TYPES[config.model_type]]
    for architecture in architectures:
        if architecture in ARCHITECTURE_FAMILIES:
            return architecture
    named = architectures or getattr(config, "model_type", None)
    raise UnsupportedModelError(
        f"config.json architectures {named!r} is not supported (supported: {', '.join(ARCHITECTURE_FAMILIES)})"
    )


def head_dim_of(config: Any) -> int:
    """The attention head size the model builds (config.json's head_dim, else hidden / heads)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def check_supported(config: HFConfig, folder: Path) -> None:
    """UnsupportedModelError, naming the config.json field, for what the engine would not run
    exactly: an architecture it lacks, quantized weights, RoPE settings it does not compute."""
    supported_architecture(config)
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (
            quantization.get("quant_method")
            if isinstance(quantization, dict)
            else getattr(quantization, "quant_method", None)
        )
        raise UnsupportedModelError(
            f"{folder} holds a quantized checkpoint ({method}): only unquantized fp32/fp16/bf16 weights load"
        )
    check_rope(config, head_dim_of(config))
    context_length(config)


def check_expert_parallel(num_experts: int, tp_size: int, experts_field: str) -> None:
    """Under expert parallelism, refuse experts that do not spread evenly over the TP ranks."""
    if tp_size > 1 and num_experts % tp_size:
        raise UnsupportedModelError(
            f"config.json {experts_field}={num_experts} is not divisible by tensor_parallel_size="
            f"{tp_size}: --enable-expert-parallel places whole experts evenly on the TP ranks "
            "(choose a TP size that divides the experts, or leave expert parallelism off)"
        )


def check_layout(config: HFConfig, layout: ParallelLayout) -> None:
    """What of a parallel layout the config alone decides: under expert parallelism, a
    mixture-of-experts model's experts must split evenly over the TP ranks."""
    experts_field = EXPERTS_FIELDS.get(getattr(config, "model_type", ""))
    if layout.enable_expert_parallel and experts_field is not None:
        check_expert_parallel(int(getattr(config, experts_field)), layout.tensor_parallel_size, experts_field)


def check_model_folder(folder: Path, layout: ParallelLayout | None = None) -> HFConfig:
    """The folder's config, once ``check_supported`` (and, given a layout, ``check_layout``) passes."""
    config = load_hf_config(folder)
    check_supported(config, Path(folder))
    if layout is not None:
        check_layout(config, layout)
    return config
