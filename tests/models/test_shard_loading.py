"""A rank reads only its slices of the checkpoint: its share of each TP-split matrix, and nothing
of other pipeline stages' layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.models import checkpoint
from tessera.models.loader import load_model, safetensors_files


def checkpoint_bytes(folder: Path) -> int:
    return sum(t.materialize().nbytes for _, t in checkpoint.iterate_lazily(safetensors_files(folder)))


def bytes_read_loading(folder: Path, **rank: int) -> int:
    before = checkpoint.BYTES_READ.bytes
    load_model(folder, dtype=torch.float32, device="cpu", **rank)
    return checkpoint.BYTES_READ.bytes - before


@pytest.mark.parametrize("tp_size", [2, 4])
def test_a_tensor_parallel_rank_reads_about_its_share(tiny_llama_dir: Path, tp_size: int) -> None:
    whole = checkpoint_bytes(tiny_llama_dir)
    assert bytes_read_loading(tiny_llama_dir) == whole
    read = bytes_read_loading(tiny_llama_dir, tp_rank=tp_size - 1, tp_size=tp_size)
    # Norm weights are replicated, and with 2 KV heads over 4 ranks each KV head twice: a little
    # over 1/tp, far under the whole.
    assert whole / tp_size <= read < whole / tp_size * 1.35


def test_a_pipeline_stage_never_reads_other_stages_layers(tiny_llama_dir: Path) -> None:
    whole = checkpoint_bytes(tiny_llama_dir)
    first = bytes_read_loading(tiny_llama_dir, pp_rank=0, pp_size=2)
    last = bytes_read_loading(tiny_llama_dir, pp_rank=1, pp_size=2)
    # Every tensor is read by exactly one stage (this model's LM head is not tied to the embedding).
    assert first + last == whole and first < whole * 0.6 and last < whole * 0.6
