"""Shapes of models the operator can check a layout against at admission (others are not checked).

The runtime refuses a layout its model cannot take (a layer partition that does not add up, heads
that do not split over the tensor-parallel ranks), but only once every rank pod has started and
loaded: for a known model the webhook says so first, naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera_operator.admission.families import FAMILY_PARALLELISM, Parallelism


@dataclass(frozen=True)
class ModelShape:
    """What bounds the parallel layout, from the model's config.json."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    # The dense MLP's width, split over the TP ranks in every layout: a mixture-of-experts model's
    # shared expert; None where every layer's MLP is routed experts only.
    intermediate_size: int | None
    head_dim: int
    max_context: int  # max_position_embeddings: the runtime refuses a longer maxModelLen
    family: str = "llama"  # a FAMILY_PARALLELISM key
    num_experts: int = 0  # routed experts per layer (0: dense)
    moe_intermediate_size: int | None = None  # one routed expert's MLP width (None: dense)

    def __post_init__(self) -> None:
        if self.family not in FAMILY_PARALLELISM:
            raise ValueError(f"family {self.family!r} is not one of {sorted(FAMILY_PARALLELISM)}")
        moe = self.num_experts > 0
        if moe != (self.moe_intermediate_size is not None) or moe != ("EP" in self.parallelism):
            raise ValueError(
                f"a {self.family} model has experts exactly when its family takes EP and it has an "
                f"expert width (num_experts {self.num_experts}, moe_intermediate_size "
                f"{self.moe_intermediate_size})"
            )

    @property
    def parallelism(self) -> frozenset[Parallelism]:
        return FAMILY_PARALLELISM[self.family]

    def min_kv_bytes_per_token(self, tensor: int, pipeline: int, element_size: int) -> int:
        """A lower bound on what one token's keys and values take on the busiest rank: its stage
        holds at least ceil(layers / pipeline) layers and its rank at least one KV head."""
        layers = -(-self.num_layers // pipeline)
        return 2 * layers * max(self.num_kv_heads // tensor, 1) * self.head_dim * element_size

    def tensor_split_problem(self, tensor: int, expert_parallel: bool = False) -> str | None:
        """Why `tensor` ranks cannot share this model's layers (the runtime's rules), or None.
        Under expert parallelism each routed expert goes whole to one rank, else every expert's
        MLP splits over the ranks."""
        if self.num_attention_heads % tensor:
            return f"{self.num_attention_heads} attention heads do not split over {tensor} ranks"
        if self.num_kv_heads % tensor and tensor % self.num_kv_heads:
            # Fewer KV heads than ranks is fine when each KV head goes whole to tensor / kv ranks.
            return (
                f"{self.num_kv_heads} key/value heads neither split over {tensor} ranks nor divide {tensor}"
            )
        if self.intermediate_size is not None and self.intermediate_size % tensor:
            mlp = "the shared expert's" if self.num_experts else "the MLP's"
            return f"{mlp} {self.intermediate_size} columns do not split over {tensor} ranks"
        if expert_parallel and self.num_experts % tensor:
            return f"{self.num_experts} experts do not split over {tensor} ranks under expertParallel"
        if (
            not expert_parallel
            and self.moe_intermediate_size is not None
            and self.moe_intermediate_size % tensor
        ):
            return (
                f"each expert's {self.moe_intermediate_size} MLP columns do not split over {tensor} ranks "
                "(spec.parallelism.expertParallel keeps every expert whole on one rank instead)"
            )
        return None


# From each model's config.json on the Hugging Face Hub: num_hidden_layers, num_attention_heads,
# num_key_value_heads, intermediate_size, head_dim (or hidden_size / num_attention_heads),
# max_position_embeddings; for mixture-of-experts models also the routed experts
# (num_local_experts or num_experts) and their width (moe_intermediate_size; Mixtral's experts
# are its intermediate_size, and it has no dense MLP).
SMOLLM2_135M = ModelShape(30, 9, 3, 1536, 64, 8192)  # HuggingFaceTB/SmolLM2-135M-Instruct
SMOLLM2_360M = ModelShape(32, 15, 5, 2560, 64, 8192)  # HuggingFaceTB/SmolLM2-360M-Instruct
LLAMA_31_8B = ModelShape(32, 32, 8, 14336, 128, 131072)  # meta-llama/Llama-3.1-8B-Instruct
LLAMA_31_70B = ModelShape(80, 64, 8, 28672, 128, 131072)  # meta-llama/Llama-3.1-70B-Instruct
LLAMA_3_70B = dataclasses.replace(LLAMA_31_70B, max_context=8192)  # meta-llama/Meta-Llama-3-70B-Instruct
MISTRAL_7B_V02 = ModelShape(32, 32, 8, 14336, 128, 32768, "mistral")  # mistralai/Mistral-7B-Instruct-v0.2
QWEN25_05B = ModelShape(24, 14, 2, 4864, 64, 32768, "qwen2")  # Qwen/Qwen2.5-0.5B-Instruct (hidden 896)
QWEN3_06B = ModelShape(28, 16, 8, 3072, 128, 40960, "qwen3")  # Qwen/Qwen3-0.6B
GEMMA2_2B = ModelShape(26, 8, 4, 9216, 256, 8192, "gemma2")  # google/gemma-2-2b
GEMMA3_1B = ModelShape(26, 4, 1, 6912, 256, 32768, "gemma3")  # google/gemma-3-1b-it (gemma3_text)
PHI3_MINI_4K = ModelShape(32, 32, 32, 8192, 96, 4096, "phi3")  # microsoft/Phi-3-mini-4k-instruct
# mistralai/Mixtral-8x7B-v0.1: 8 experts (top-2) of width 14336.
MIXTRAL_8X7B = ModelShape(32, 32, 8, None, 128, 32768, "mixtral", 8, 14336)
# Qwen/Qwen1.5-MoE-A2.7B (qwen2_moe): 60 experts (top-4) of width 1408, a shared expert of 5632.
QWEN15_MOE_A27B = ModelShape(24, 16, 16, 5632, 128, 8192, "qwen2_moe", 60, 1408)
# Qwen/Qwen3-30B-A3B: 128 experts (top-8) of width 768 in every layer (decoder_sparse_step 1,
# no mlp_only_layers), no shared expert.
QWEN3_30B_A3B = ModelShape(48, 32, 4, None, 128, 40960, "qwen3_moe", 128, 768)

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
    "mistral-7b-instruct-v0.2": MISTRAL_7B_V02,
    "qwen2.5-0.5b-instruct": QWEN25_05B,
    "qwen3-0.6b": QWEN3_06B,
    "gemma-2-2b": GEMMA2_2B,
    "gemma-3-1b-it": GEMMA3_1B,
    "phi-3-mini-4k-instruct": PHI3_MINI_4K,
    "mixtral-8x7b-v0.1": MIXTRAL_8X7B,
    "mixtral-8x7b-instruct-v0.1": MIXTRAL_8X7B,
    "qwen1.5-moe-a2.7b": QWEN15_MOE_A27B,
    "qwen1.5-moe-a2.7b-chat": QWEN15_MOE_A27B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
}


def known_model(source: str) -> ModelShape | None:
    text = source.strip().lower().removesuffix("/")
    for candidate in (text, text.rsplit("/", 1)[-1], text.rsplit("/", 1)[-1].removesuffix(".gguf")):
        if candidate in KNOWN_MODELS:
            return KNOWN_MODELS[candidate]
    return None
