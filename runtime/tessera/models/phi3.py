"""Phi-3: the Llama layer, with a checkpoint that stores Q, K and V as one ``qkv_proj`` tensor
([q; k; v] by rows) and the MLP's gate and up as one ``gate_up_proj`` ([gate; up]).

The fused tensors are cut into their parts unread (``checkpoint.take_rows``) and each part goes
to the fused layer's loader as a separate Llama checkpoint tensor would, so a tensor-parallel rank
reads only its heads' rows of q, k and v and its slice of gate and up. Every layer slides when
config.json sets sliding_window (``llama.sliding_window_of_layer``); the RoPE scalings Phi-3 uses
(longrope, for the 128k models) are in ``layers/rotary.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tessera.models.checkpoint import CheckpointTensor, take_rows
from tessera.models.llama import LlamaForCausalLM
from tessera.models.support import head_dim_of

Weights = Iterable[tuple[str, torch.Tensor | CheckpointTensor]]


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _parts(self) -> dict[str, list[tuple[str, int]]]:
        """fused checkpoint name fragment -> (Llama name fragment, rows) of each part, in order."""
        config = self.config
        head_dim = head_dim_of(config)
        q = config.num_attention_heads * head_dim
        kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        inter = config.intermediate_size
        return {
            ".qkv_proj.": [(".q_proj.", q), (".k_proj.", kv), (".v_proj.", kv)],
            ".gate_up_proj.": [(".gate_proj.", inter), (".up_proj.", inter)],
        }

    def _split_fused(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor | CheckpointTensor]]:
        parts = self._parts()
        for name, tensor in weights:
            fused = next((fragment for fragment in parts if fragment in name), None)
            if fused is None:
                yield name, tensor
                continue
            rows = sum(size for _, size in parts[fused])
            if not tensor.shape or tensor.shape[0] != rows:
                # Cut to fit, another model's tensor would load as garbage: refuse it instead.
                raise ValueError(
                    f"{name}: checkpoint tensor of shape {tuple(tensor.shape)} does not hold the {rows} rows "
                    "config.json implies"
                )
            start = 0
            for fragment, size in parts[fused]:
                yield name.replace(fused, fragment), take_rows(tensor, start, size)
                start += size
