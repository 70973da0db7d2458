"""Tiny mixture-of-experts models of each family, shared by the MoE tests (8 experts, top 2)."""

from __future__ import annotations

from typing import Any

MOE_VARIANTS: dict[str, dict[str, Any]] = {
    # Every layer sparse; a window of 8 (the scenario's sequences reach 21 tokens) on every layer.
    "mixtral-sliding-window": {
        "arch": "mixtral",
        "intermediate": 64,
        "overrides": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8},
    },
    # The shared expert with its gate; layer 1 dense (mlp_only_layers); top-k weights not renormalised.
    "qwen2_moe-shared-expert": {
        "arch": "qwen2_moe",
        "overrides": {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
        },
    },
    # Per-head q/k norms; renormalised top-k; every second layer sparse (decoder_sparse_step).
    "qwen3_moe-renormalised": {
        "arch": "qwen3_moe",
        "overrides": {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
            "head_dim": 32,
        },
    },
}
