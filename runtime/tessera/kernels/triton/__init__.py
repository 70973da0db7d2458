"""Triton kernels for attention over the paged KV cache (the GPU path of
``models/layers/attention.py``).

- ``write_kv_cache``: the step's new K and V into their slots, one launch.
- ``decode_attention``: one query token per sequence, split-K over long contexts.
- ``prefill_attention``: ragged prefills and chunked prefills, all sequences in one launch
  (its tile list from ``prefill_tiles``, built once per forward).

All take GQA, a sliding window, logit soft-capping, fp16/bf16/fp32 (fp32 accumulation) and
head_dim up to 256 (non-powers of two padded). The kernels are compiled for the GPU, or run
on CPU tensors by Triton's interpreter when TRITON_INTERPRET=1 was set before this package
was imported (``INTERPRETED``): that is how the tests run them without a GPU.
"""

from __future__ import annotations

from tessera.kernels.triton.attention_tile import INTERPRETED
from tessera.kernels.triton.cache_write import write_kv_cache
from tessera.kernels.triton.decode_attention import decode_attention, split_context
from tessera.kernels.triton.prefill_attention import (
    PrefillTiles,
    prefill_attention,
    prefill_block_q,
    prefill_tiles,
)

__all__ = [
    "INTERPRETED",
    "PrefillTiles",
    "decode_attention",
    "prefill_attention",
    "prefill_block_q",
    "prefill_tiles",
    "split_context",
    "write_kv_cache",
]
