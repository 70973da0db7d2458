"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) on a paged KV cache, TP- and PP-ready.

One implementation covers the family: they differ only in config details read here (QKV
bias for Qwen2, sliding windows, RoPE scaling, tied embeddings). Parameter names follow
Hugging Face checkpoints except the fused ``qkv_proj`` and ``gate_up_proj``, which
``load_weights`` fills from the separate checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tessera.distributed.communication import padded_rows, tp_all_gather
from tessera.distributed.intermediate_tensors import IntermediateTensors
from tessera.models.checkpoint import CheckpointTensor
from tessera.models.layers.attention import Attention, AttentionMetadata, AttentionPlan, GatherWorkspace
from tessera.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tessera.models.layers.linear import QKVParallelLinear, RowParallelLinear, SiluGatedLinear, copy_checked
from tessera.models.layers.norm import HeadRMSNorm, RMSNorm
from tessera.models.layers.rotary import RotaryEmbedding, apply_rotary_
from tessera.models.rope_config import context_length, rope_parameters
from tessera.topology import SINGLE_RANK, RankPlacement

# checkpoint name fragment -> (fused parameter fragment, shard id)
STACKED_PARAMS: list[tuple[str, str, Any]] = [
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]


def sliding_window_of_layer(config: Any, layer: int) -> int | None:
    """``layer``'s attention window as transformers' model code applies it: Llama's attention has
    none (whatever config.json holds); Mistral's and Phi-3's layers all slide; Qwen2's and Qwen3's (when asked) and
    Ministral's (a Mistral config with layer_types) only those its layer_types mark. Mixtral's
    and Qwen3-MoE's all slide (Qwen3-MoE when asked); Qwen2-MoE's as its layer_types mark."""
    window = getattr(config, "sliding_window", None)
    family = getattr(config, "model_type", "")
    every_layer = ("mistral", "phi3", "mixtral", "qwen3_moe")
    if not window or family not in ("ministral", "qwen2", "qwen3", "qwen2_moe", *every_layer):
        return None
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not getattr(
        config, "use_sliding_window", False
    ):
        return None
    layer_types = getattr(config, "layer_types", None)
    if family not in every_layer and layer_types is not None and layer_types[layer] != "sliding_attention":
        return None
    return int(window)


class PPMissingLayer(nn.Identity):
    """Placeholder for a layer that lives on another pipeline stage (keeps checkpoint indices)."""


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer: int, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__()
        # Families that norm each query and key head before RoPE (Qwen3, Gemma 3) set these.
        self.q_norm: HeadRMSNorm | None = None
        self.k_norm: HeadRMSNorm | None = None
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        qkv_bias = qkv_bias or (config.model_type == "qwen2_moe" and bool(config.qkv_bias))
        o_bias = getattr(config, "attention_bias", False) and config.model_type != "qwen2"
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_dim,
            heads,
            kv_heads,
            bias=qkv_bias,
            params_dtype=dtype,
            placement=placement,
        )
        self.o_proj = RowParallelLinear(
            heads * head_dim,
            hidden,
            bias=o_bias,
            params_dtype=dtype,
            placement=placement,
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
        )
        self.attn = Attention(
            self.num_heads, head_dim, self.num_kv_heads, sliding_window=sliding_window_of_layer(config, layer)
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        # With sequence parallelism qkv_proj gathers the token shards (padded to a multiple of
        # the TP size): attention runs on the real tokens only, the rows rope has.
        n = rope.shape[0]
        qkv = self.qkv_proj(hidden_states)[:n]
        heads = qkv.view(n, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3, Gemma 3: each head normed
            self.q_norm.normalize_heads_(heads[:, : self.num_heads])
            self.k_norm.normalize_heads_(heads[:, self.num_heads : self.num_heads + self.num_kv_heads])
        # Q and K sit side by side in the fused output: rotate all their heads in one pass, in place.
        apply_rotary_(heads[:, : self.num_heads + self.num_kv_heads], rope)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        attended = self.attn(qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:], kv_cache, plan)
        return self.o_proj(attended)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported (silu is)")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = SiluGatedLinear(
            config.hidden_size,
            [inter, inter],
            bias=bias,
            params_dtype=dtype,
            placement=placement,
        )
        self.down_proj = RowParallelLinear(
            inter,
            config.hidden_size,
            bias=bias,
            params_dtype=dtype,
            placement=placement,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Norms and residual adds run on whatever rows arrive: all tokens, or with sequence
    parallelism this rank's shard of them (the linears gather and scatter around themselves)."""

    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: Any, layer: int, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = self.attention_class(config, layer, dtype, placement)
        self.mlp = self.make_mlp(config, layer, dtype, placement)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)

    def make_mlp(self, config: Any, layer: int, dtype: torch.dtype, placement: RankPlacement) -> nn.Module:
        """Layer ``layer``'s MLP (families with sparse layers build theirs here)."""
        return LlamaMLP(config, dtype, placement)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, rope, kv_cache, plan)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        placement: RankPlacement,
        layer_class: type[nn.Module] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.start_layer, self.end_layer = placement.stage_layers(config.num_hidden_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, placement)
            if placement.is_first_stage
            else None
        )
        self.layers = nn.ModuleList(
            layer_class(config, i, dtype, placement)
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if placement.is_last_stage else None
        )


class LlamaForCausalLM(nn.Module):
    """The model interface the runner uses: forward, compute_logits, kv_cache_spec, load_weights.

    Other families reuse it by subclassing: ``decoder_layer_class`` builds their layers and
    ``stacked_params`` says which checkpoint tensors fill which fused parameter."""

    decoder_layer_class: type[nn.Module] = LlamaDecoderLayer
    stacked_params: list[tuple[str, str, Any]] = STACKED_PARAMS

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        placement: RankPlacement = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.placement = placement
        self.num_layers = config.num_hidden_layers
        self.tp_size = placement.tp_size
        self.sequence_parallel = placement.shards_tokens
        self.layer_range = placement.stage_layers(self.num_layers)
        self.is_first_stage, self.is_last_stage = placement.is_first_stage, placement.is_last_stage
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, dtype, placement, self.decoder_layer_class)
        self.lm_head: ParallelLMHead | None = None
        if self.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype, placement)
            if self.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.tie_to(self.model.embed_tokens)
        first_attention = self._local_layers()[0].self_attn
        self._kv_heads, self._head_dim = first_attention.num_kv_heads, first_attention.head_dim
        self.max_context = self.context_length(config)
        self.rotary = self.build_rotary(config, dtype)
        self._workspace = GatherWorkspace()
        # The local layers as one native call (models/decoder_stack.py), set once the weights are
        # packed; None runs them one module at a time.
        self.decoder_stack: Any = None

    def context_length(self, config: Any) -> int:
        """The longest sequence this model runs (``max_context``)."""
        return context_length(config)

    def build_rotary(self, config: Any, dtype: torch.dtype) -> nn.Module:
        """The RoPE table(s) ``layer_ropes`` looks positions up in (one, for this family)."""
        return RotaryEmbedding(
            self._head_dim,
            self.max_context,
            rope_parameters(config),
            dtype,
            max_position_embeddings=int(getattr(config, "max_position_embeddings", self.max_context)),
        )

    def layer_ropes(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """Each local layer's cos/sin rows for ``positions`` (a family whose layers rotate by
        different tables overrides this with ``build_rotary``)."""
        assert isinstance(self.rotary, RotaryEmbedding)
        return [self.rotary.lookup(positions)] * len(self._local_layers())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input hidden states (a family that scales its embedding overrides this)."""
        assert self.model.embed_tokens is not None
        return self.model.embed_tokens(input_ids)

    def _local_layers(self) -> list[Any]:
        start, end = self.layer_range
        return [self.model.layers[i] for i in range(start, end)]

    @property
    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(local layers, KV heads on this rank, head_dim): the runner allocates one cache per local layer."""
        start, end = self.layer_range
        return end - start, self._kv_heads, self._head_dim

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            if input_ids is None or self.model.embed_tokens is None:
                raise ValueError("the first pipeline stage needs input_ids")
            hidden_states = self.embed(input_ids)
            residual: torch.Tensor | None = None
        else:
            if intermediate_tensors is None:
                raise ValueError("a later pipeline stage needs the previous stage's intermediate_tensors")
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        layers = self._local_layers()
        if len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} local layers")
        plan = AttentionPlan.build(
            attn_metadata, kv_caches[0].shape[2], hidden_states.device, self._workspace
        )
        ropes = self.layer_ropes(positions)
        if self.decoder_stack is not None and plan.native is not None:
            md = plan.metadata
            hidden_states, residual = self.decoder_stack.forward(
                hidden_states,
                residual,
                ropes[0],  # the stack runs Llama layers only: one table
                kv_caches,
                md.slot_mapping,
                md.block_tables,
                md.seq_lens,
                md.query_start_loc,
            )
        else:
            for layer, kv_cache, rope in zip(layers, kv_caches, ropes, strict=True):
                hidden_states, residual = layer(hidden_states, residual, rope, kv_cache, plan)
        if not self.is_last_stage:
            assert residual is not None
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        assert self.model.norm is not None
        hidden_states, _ = self.model.norm(hidden_states, residual)
        if self.sequence_parallel:  # logits need every token's row: gather the shards, drop padding
            hidden_states = tp_all_gather(hidden_states, dim=0)[: positions.shape[0]]
        return hidden_states

    def intermediate_rows(self, num_tokens: int) -> int:
        """Rows of each tensor this rank exchanges with its pipeline neighbours for a batch."""
        if self.sequence_parallel:
            return padded_rows(num_tokens, self.tp_size) // self.tp_size
        return num_tokens

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab] in the model's dtype (pass only the rows whose next token is
        sampled). The sampler widens them to fp32 where it computes with them; greedy sampling
        takes the argmax as they are, which is the same (at decode of 64 bf16 rows, 12.6 MB less
        written and read a step)."""
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> set[str]:
        """Copy checkpoint tensors into this rank's parameters; returns the parameter names filled.

        A fused parameter counts as filled only once every part arrived (q, k and v; gate and up).
        A tensor of this rank's that has no parameter to go to is an error, not skipped: it means
        a checkpoint the model does not describe (quantized, or biases its config leaves out).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        parts: dict[str, set[Any]] = {}
        unplaced: list[str] = []
        for name, tensor in weights:
            try:
                self._place(name, tensor, params, loaded, parts, unplaced)
            except ValueError as exc:  # a shape config.json does not imply: say which tensor
                raise ValueError(f"{name}: {exc}") from None
        if unplaced:
            raise ValueError(
                f"checkpoint tensors with no place in this {type(self).__name__}: {', '.join(unplaced[:8])}"
                f"{' ...' if len(unplaced) > 8 else ''} (does config.json describe these weights?)"
            )
        return loaded

    def _place(
        self,
        name: str,
        tensor: torch.Tensor | CheckpointTensor,
        params: dict[str, nn.Parameter],
        loaded: set[str],
        parts: dict[str, set[Any]],
        unplaced: list[str],
    ) -> None:
        """One checkpoint tensor into the parameters it feeds (see load_weights)."""
        for target in self._targets(name):
            fused = next(((frag, new, sid) for frag, new, sid in self.stacked_params if frag in target), None)
            if fused is not None:
                frag, new, shard_id = fused
                target = target.replace(frag, new)
                if target not in params:
                    unplaced.append(name)
                    continue
                param = params[target]
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                parts.setdefault(target, set()).add(shard_id)
                if parts[target] != self._fused_parts(new):
                    continue
            elif target in params:
                param = params[target]
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    copy_checked(param.data, tensor)
                else:
                    loader(param, tensor)
            else:
                unplaced.append(name)
                continue
            loaded.add(target)

    def _fused_parts(self, fused: str) -> set[Any]:
        """The shard ids that together fill the fused parameter named by ``fused``."""
        return {shard for _, other, shard in self.stacked_params if other == fused}

    def _targets(self, name: str) -> list[str]:
        """Which local parameters a checkpoint tensor feeds ([] for other stages' layers)."""
        if "rotary_emb.inv_freq" in name:
            return []
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            start, end = self.layer_range
            # Past the model's last layer it is no stage's: left unplaced, an error.
            return [name] if start <= index < end or index >= self.num_layers else []
        if name == "lm_head.weight":
            return [name] if self.is_last_stage and not self.tie_word_embeddings else []
        if name == "model.embed_tokens.weight":
            targets = [name] if self.model.embed_tokens is not None else []
            if self.tie_word_embeddings and self.is_last_stage and self.model.embed_tokens is None:
                targets.append("lm_head.weight")  # a tied last stage without the embedding: its LM head
            return targets
        if name.startswith("model.norm."):
            return [name] if self.is_last_stage else []
        return [name]

    def missing_parameters(self, loaded: set[str]) -> list[str]:
        """Parameters no checkpoint tensor filled (tied parameters count once, by identity)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        filled = {id(params[name]) for name in loaded}
        return sorted(name for name, param in params.items() if id(param) not in filled)
