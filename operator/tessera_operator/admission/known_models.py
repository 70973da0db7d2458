"""Shapes of models the operator can check a layout against at admission (others are not checked).

The runtime refuses a layout its model cannot take (a layer partition that does not add up, heads
that do not split over the tensor-parallel ranks), but only once every rank pod has started and
loaded: for a known model the webhook says so first, naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What bounds the parallel layout, from the model's config.json."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int
    max_context: int  # max_position_embeddings: the runtime refuses a longer maxModelLen

    def min_kv_bytes_per_token(self, tensor: int, pipeline: int, element_size: int) -> int:
        """A lower bound on what one token's keys and values take on the busiest rank: its stage
        holds at least ceil(layers / pipeline) layers and its rank at least one KV head."""
        layers = -(-self.num_layers // pipeline)
        return 2 * layers * max(self.num_kv_heads // tensor, 1) * self.head_dim * element_size

    def tensor_split_problem(self, tensor: int) -> str | None:
        """Why `tensor` ranks cannot share this model's layers (the runtime's rules), or None."""
        if self.num_attention_heads % tensor:
            return f"{self.num_attention_heads} attention heads do not split over {tensor} ranks"
        if self.num_kv_heads % tensor and tensor % self.num_kv_heads:
            # Fewer KV heads than ranks is fine when each KV head goes whole to tensor / kv ranks.
            return (
                f"{self.num_kv_heads} key/value heads neither split over {tensor} ranks nor divide {tensor}"
            )
        if self.intermediate_size % tensor:
            return f"the MLP's {self.intermediate_size} columns do not split over {tensor} ranks"
        return None


# From each model's config.json: layers, attention heads, key/value heads, MLP width, head
# dimension, max_position_embeddings.
SMOLLM2_135M = ModelShape(30, 9, 3, 1536, 64, 8192)
SMOLLM2_360M = ModelShape(32, 15, 5, 2560, 64, 8192)
LLAMA_31_8B = ModelShape(32, 32, 8, 14336, 128, 131072)
LLAMA_31_70B = ModelShape(80, 64, 8, 28672, 128, 131072)
LLAMA_3_70B = dataclasses.replace(LLAMA_31_70B, max_context=8192)

# Keys are lower-case; a source matches by its full text or its last path component
# (so `/models/Llama-3.1-70B-Instruct` and `meta-llama/Llama-3.1-70B-Instruct` both match).
KNOWN_MODELS: dict[str, ModelShape] = {
    "smollm2": SMOLLM2_135M,
    "smollm2-135m": SMOLLM2_135M,
    "smollm2-135m-instruct": SMOLLM2_135M,
    "smollm2-360m-instruct": SMOLLM2_360M,
    "llama-3.1-8b-instruct": LLAMA_31_8B,
    "llama-3.1-70b-instruct": LLAMA_31_70B,
    "llama-3.3-70b-instruct": LLAMA_31_70B,
    "meta-llama-3-70b-instruct": LLAMA_3_70B,
}


def known_model(source: str) -> ModelShape | None:
    text = source.strip().lower().removesuffix("/")
    for candidate in (text, text.rsplit("/", 1)[-1], text.rsplit("/", 1)[-1].removesuffix(".gguf")):
        if candidate in KNOWN_MODELS:
            return KNOWN_MODELS[candidate]
    return None
