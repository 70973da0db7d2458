"""The Triton attention backend: the GPU path of ``Attention`` (``tessera.kernels.triton``).

Each layer writes its new K/V into the paged cache with one kernel, then attends the decodes
(split-K) and all prefills (one launch over a ragged batch) straight from the blocks: no
context is copied out, no Python loop runs over sequences. What the kernels need from the
batch layout (device copies of the metadata, the prefill tile list) is built once per
forward in ``TritonAttentionPlan`` and shared by every layer.

Which backend a forward takes: ``TESSERA_ATTENTION_BACKEND`` (read once, at import):
- ``auto`` (default): Triton on CUDA devices when triton imports; otherwise the CPU kernels
  on CPU, the ATen formulation elsewhere (``attention.py``).
- ``triton``: Triton on every device; on CPU tensors that needs Triton's interpreter
  (TRITON_INTERPRET=1 before the kernels are imported), which is how tests run this path.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tessera.kernels.triton import PrefillTiles

BACKEND_VARIABLE = "TESSERA_ATTENTION_BACKEND"
BACKENDS = ("auto", "triton")
# Tests comparing backends set this attribute instead of the environment.
SELECTED = os.environ.get(BACKEND_VARIABLE, "auto")


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernels() -> ModuleType:
    # Imported on first use: Triton decorates the kernels on import (reading TRITON_INTERPRET
    # then), and a CPU-only process need not pay for importing it.
    return importlib.import_module("tessera.kernels.triton")


def uses_triton(device: torch.device) -> bool:
    """Whether this forward's attention runs on the Triton kernels."""
    if SELECTED not in BACKENDS:
        raise ValueError(f"{BACKEND_VARIABLE}={SELECTED!r} is not a backend ({', '.join(BACKENDS)})")
    if SELECTED == "auto":
        return device.type == "cuda" and _triton_importable()
    if not _triton_importable():
        raise RuntimeError(f"{BACKEND_VARIABLE}=triton, but the triton package is not installed")
    if device.type != "cuda" and not _kernels().INTERPRETED:
        raise RuntimeError(
            f"{BACKEND_VARIABLE}=triton on a {device.type} device needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before tessera imports its Triton kernels"
        )
    return True


@dataclass
class TritonAttentionPlan:
    kernels: ModuleType
    slot_mapping: torch.Tensor  # the metadata's tensors, on the device
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_list: list[int]
    num_decodes: int
    max_decode_len: int  # sets the decode partitions
    _tiles: dict[int, PrefillTiles] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        query_start_loc_list: list[int],
        seq_lens_list: list[int],
        num_decodes: int,
        device: torch.device,
    ) -> TritonAttentionPlan:
        def on_device(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device, non_blocking=True)

        return cls(
            kernels=_kernels(),
            slot_mapping=on_device(slot_mapping),
            block_tables=on_device(block_tables),
            seq_lens=on_device(seq_lens),
            query_start_loc=on_device(query_start_loc),
            query_start_loc_list=query_start_loc_list,
            num_decodes=num_decodes,
            max_decode_len=max(seq_lens_list[:num_decodes], default=0),
        )

    def prefill_tiles(self, block_q: int) -> PrefillTiles:
        """The prefill launch's tile list for tiles of block_q rows, built by the first layer
        that asks (the tile height follows the layer's heads, the same in most models)."""
        if block_q not in self._tiles:
            self._tiles[block_q] = self.kernels.prefill_tiles(
                self.query_start_loc_list, self.num_decodes, block_q, self.slot_mapping.device
            )
        return self._tiles[block_q]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        sliding_window: int | None,
        softcap: float,
    ) -> torch.Tensor:
        """Write k/v into kv_cache, then attend every query row of q; [N, heads * head_dim]."""
        kernels = self.kernels
        kernels.write_kv_cache(k, v, kv_cache, self.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        common = (kv_cache, self.block_tables, self.seq_lens, self.query_start_loc)
        kernels.decode_attention(
            out, q, *common, self.num_decodes, self.max_decode_len, scale, sliding_window, softcap
        )
        if self.num_decodes == len(self.query_start_loc_list) - 1:
            # All decodes: no tile list to build (nor a host-to-device copy, which a CUDA graph
            # capturing this forward must not contain).
            return out
        head_dim = kv_cache.shape[-1]
        tiles = self.prefill_tiles(kernels.prefill_block_q(head_dim, num_heads // kv_cache.shape[3]))
        kernels.prefill_attention(out, q, *common, tiles, scale, sliding_window, softcap)
        return out
