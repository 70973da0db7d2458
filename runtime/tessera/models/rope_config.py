"""A config's RoPE settings as transformers reads them, checked against what the engine computes.

No torch here: ``tessera serve`` checks a model folder with it before it starts any process
(``models/support.py``), and the rank processes' RoPE tables (``layers/rotary.py``) read the
same parameters.
"""

from __future__ import annotations

import logging
from typing import Any

from tessera.models.hf_config import UnsupportedModelError

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 3's RoPE bases when config.json names none (Gemma3TextConfig.default_theta).
GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}

# rope_type -> the fields it needs (beyond rope_theta) and those it may have; transformers'
# RotaryEmbeddingConfigMixin._validate_*_rope_parameters, whose functions rotary.py follows.
ROPE_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "llama3": (
        frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
        frozenset(),
    ),
    "yarn": (
        frozenset({"factor", "original_max_position_embeddings"}),
        frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    ),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "longrope": (
        frozenset({"short_factor", "long_factor", "original_max_position_embeddings"}),
        frozenset({"attention_factor", "factor"}),
    ),
}
# Keys every type may carry: its name (either spelling), the base and the rotary fraction
# (checked below). Any other key is refused: transformers only warns about it, but a key such as
# mrope_section or long_mscale means a computation other than the one done here.
_COMMON_FIELDS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings whichever way the config spells them (transformers 5: ``rope_parameters``;
    older files: ``rope_theta`` + ``rope_scaling``), completed as transformers' config classes
    complete them (``standardize_rope_params``). Given both, ``rope_scaling`` wins, as in
    transformers (a model card's scaling added to a newer file must not go unread)."""
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    params = dict(scaling or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    partial_rotary_factor = getattr(config, "partial_rotary_factor", None)
    if partial_rotary_factor is not None:
        params.setdefault("partial_rotary_factor", partial_rotary_factor)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if hasattr(config, "original_max_position_embeddings"):  # a top-level field wins (Phi-3's)
            params["original_max_position_embeddings"] = config.original_max_position_embeddings
        else:
            params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def rope_field(config: Any) -> str:
    """Which config.json key holds the RoPE settings (for messages)."""
    return "rope_scaling" if getattr(config, "rope_scaling", None) else "rope_parameters"


def check_rope_parameters(params: dict[str, Any], head_dim: int, field: str = "rope_parameters") -> None:
    """Refuse settings the engine would not compute exactly as transformers does, naming the
    config.json field (``field``: the key that holds ``params``)."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_FIELDS:
        raise UnsupportedModelError(
            f"config.json {field}.rope_type {rope_type!r} is not supported ({', '.join(ROPE_FIELDS)} are)"
        )
    partial = float(params.get("partial_rotary_factor", 1.0))
    if int(head_dim * partial) != head_dim:
        raise UnsupportedModelError(
            f"config.json partial_rotary_factor {partial} is not supported: RoPE rotates whole heads "
            "here (only 1.0 is)"
        )
    required, optional = ROPE_FIELDS[rope_type]
    missing = sorted(required - params.keys())
    if missing:
        raise UnsupportedModelError(
            f"config.json {field}.{missing[0]} is missing (rope_type {rope_type!r} needs {', '.join(sorted(required))})"
        )
    unknown = sorted(params.keys() - required - optional - _COMMON_FIELDS)
    if unknown:
        raise UnsupportedModelError(
            f"config.json {field}.{unknown[0]} is not supported with rope_type {rope_type!r} "
            f"(it may have {', '.join(sorted(required | optional)) or 'only rope_theta'})"
        )
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(params[name]) != head_dim // 2:
                raise UnsupportedModelError(
                    f"config.json {field}.{name} has {len(params[name])} entries, not head_dim / 2 = {head_dim // 2}"
                )


def gemma3_rope_parameters(config: Any) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE settings as ``Gemma3TextConfig`` reads them: ``rope_parameters``
    keyed by layer type, or the older spelling (``rope_theta`` and ``rope_scaling`` for full
    layers, ``rope_local_base_freq`` for sliding ones)."""
    given = getattr(config, "rope_parameters", None) or {}
    params = {kind: dict(given.get(kind) or {"rope_type": "default"}) for kind in (FULL, SLIDING)}
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        params[FULL].update(scaling)
    params[FULL].setdefault("rope_theta", getattr(config, "rope_theta", GEMMA3_THETA[FULL]))
    params[SLIDING].setdefault("rope_theta", getattr(config, "rope_local_base_freq", GEMMA3_THETA[SLIDING]))
    for kind_params in params.values():
        kind_params.setdefault("rope_type", kind_params.get("type", "default"))
    return params


def rope_parameter_sets(config: Any) -> dict[str, dict[str, Any]]:
    """Every RoPE table the model builds, by the layer type that rotates by it: Gemma 3 has one
    for its full and one for its sliding layers, every other family one for all layers."""
    if getattr(config, "model_type", None) == "gemma3_text":
        return gemma3_rope_parameters(config)
    return {"all": rope_parameters(config)}


def check_rope(config: Any, head_dim: int) -> None:
    """``check_rope_parameters`` on each of the config's own settings."""
    for kind, params in rope_parameter_sets(config).items():
        field = rope_field(config) if kind == "all" else f"rope_parameters.{kind}"
        check_rope_parameters(params, head_dim, field)


def context_length(config: Any) -> int:
    """The longest sequence the model's positions cover, per RoPE type:

    - default, llama3 (its scaling already counts in), longrope (positions past
      original_max_position_embeddings take long_factor, see rotary.py): max_position_embeddings;
    - linear: max_position_embeddings times the factor;
    - yarn: original_max_position_embeddings times the factor (its frequencies do not depend on
      the length), or max_position_embeddings where that is longer;
    - dynamic: max_position_embeddings. Dynamic NTK recomputes the frequencies for each longer
      sequence in transformers; within max_position_embeddings they are the table's, so the
      engine's context stops there rather than approximate past it.
    """
    length = int(getattr(config, "max_position_embeddings", 4096))
    if getattr(config, "model_type", None) == "gemma3_text":
        return length  # its max_position_embeddings already counts the full layers' linear scaling
    params = rope_parameters(config)
    if params["rope_type"] == "linear":
        length = int(length * float(params["factor"]))
    elif params["rope_type"] == "yarn":
        original = params["original_max_position_embeddings"]
        factor = params["factor"] if params.get("factor") is not None else length / original
        length = max(length, int(original * float(factor)))
    elif params["rope_type"] == "dynamic":
        logger.info(
            "rope_type 'dynamic': the context is capped at max_position_embeddings=%d, where dynamic "
            "NTK scaling equals transformers' (past it, transformers recomputes the frequencies per length)",
            length,
        )
    return length
