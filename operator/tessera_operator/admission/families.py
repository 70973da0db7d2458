"""Which ways of splitting a model each model family takes (docs/architecture.md has the table).

Keyed by config.json's model_type (gemma3 also for gemma3_text). Every family splits its heads
and MLPs over tensor-parallel ranks (TP), its layers over pipeline stages (PP) and its
activations over tokens inside a TP group (SP); only mixture-of-experts families have experts
to spread whole over the TP ranks (EP, vLLM's --enable-expert-parallel).
"""

from __future__ import annotations

from typing import Literal

Parallelism = Literal["TP", "PP", "SP", "EP"]

DENSE: frozenset[Parallelism] = frozenset({"TP", "PP", "SP"})
MIXTURE_OF_EXPERTS: frozenset[Parallelism] = DENSE | {"EP"}

FAMILY_PARALLELISM: dict[str, frozenset[Parallelism]] = {
    "llama": DENSE,
    "mistral": DENSE,
    "ministral": DENSE,
    "qwen2": DENSE,
    "qwen3": DENSE,
    "gemma2": DENSE,
    "gemma3": DENSE,
    "phi3": DENSE,
    "mixtral": MIXTURE_OF_EXPERTS,
    "qwen2_moe": MIXTURE_OF_EXPERTS,
    "qwen3_moe": MIXTURE_OF_EXPERTS,
}
