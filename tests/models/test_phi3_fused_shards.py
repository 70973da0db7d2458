"""Phi-3's fused checkpoint tensors (qkv_proj = [q; k; v], gate_up_proj = [gate; up]) split over
tensor-parallel ranks: each rank reads exactly its rows of each part, and the ranks' parameters
put together are the single rank's, which are the checkpoint's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.models import checkpoint
from tessera.models.hf_config import load_hf_config
from tessera.models.loader import safetensors_files
from tessera.models.phi3 import Phi3ForCausalLM
from tessera.topology import RankPlacement
from tests.fixtures.models import make_tiny_model_dir

HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, 192


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("phi3"), arch="phi3", num_layers=2, heads=HEADS, kv_heads=KV_HEADS
    )


def load_rank(
    folder: Path, monkeypatch: pytest.MonkeyPatch, tp_rank: int = 0, tp_size: int = 1
) -> tuple[Phi3ForCausalLM, dict[str, list[tuple[int, int]]]]:
    """The rank's model, loaded (not repacked), and the file rows it read of each fused tensor."""
    reads: dict[str, list[tuple[int, int]]] = {}
    read = checkpoint.CheckpointTensor._read

    def recording(self: checkpoint.CheckpointTensor, bounds: list[slice]) -> torch.Tensor:
        if "qkv_proj" in self.name or "gate_up_proj" in self.name:
            first = self._rows[0]
            reads.setdefault(self.name, []).append((first + bounds[0].start, first + bounds[0].stop))
        return read(self, bounds)

    monkeypatch.setattr(checkpoint.CheckpointTensor, "_read", recording)
    placement = RankPlacement(tp_rank=tp_rank, tp_size=tp_size)
    model = Phi3ForCausalLM(load_hf_config(folder), torch.float32, placement)
    with torch.no_grad():
        loaded = model.load_weights(checkpoint.iterate_lazily(safetensors_files(folder)))
    assert model.missing_parameters(loaded) == []
    monkeypatch.undo()
    return model, reads


def rank_rows(tp_rank: int, tp_size: int) -> dict[str, list[tuple[int, int]]]:
    """The rows of each fused tensor one rank holds: its query heads, the KV heads they use, its
    slice of gate and of up."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    q_rows = q // tp_size
    kv_rank = tp_rank // max(tp_size // KV_HEADS, 1)
    kv_rows = kv // min(tp_size, KV_HEADS)
    inter_rows = INTER // tp_size
    return {
        "qkv_proj": [
            (tp_rank * q_rows, (tp_rank + 1) * q_rows),
            (q + kv_rank * kv_rows, q + (kv_rank + 1) * kv_rows),
            (q + kv + kv_rank * kv_rows, q + kv + (kv_rank + 1) * kv_rows),
        ],
        "gate_up_proj": [
            (tp_rank * inter_rows, (tp_rank + 1) * inter_rows),
            (INTER + tp_rank * inter_rows, INTER + (tp_rank + 1) * inter_rows),
        ],
    }


def fused(model: Phi3ForCausalLM, layer: int) -> dict[str, Any]:
    """The layer's fused parameters by checkpoint name."""
    block = model.model.layers[layer]
    return {
        f"model.layers.{layer}.self_attn.qkv_proj.weight": block.self_attn.qkv_proj.weight,
        f"model.layers.{layer}.mlp.gate_up_proj.weight": block.mlp.gate_up_proj.weight,
    }


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_reads_only_its_rows_and_the_ranks_make_up_the_single_rank(
    phi3_dir: Path, tp_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    single, _ = load_rank(phi3_dir, monkeypatch)
    tensors = {name: t.materialize() for name, t in checkpoint.iterate_lazily(safetensors_files(phi3_dir))}
    ranks = []
    for tp_rank in range(tp_size):
        model, reads = load_rank(phi3_dir, monkeypatch, tp_rank, tp_size)
        ranks.append(model)
        expected = rank_rows(tp_rank, tp_size)
        for name, rows in reads.items():
            assert sorted(rows) == expected[name.split(".")[-2]], name
        assert len(reads) == 2 * 2  # both fused tensors of both layers, and nothing else of them
    for layer in range(2):
        whole = fused(single, layer)
        for name, parameter in whole.items():
            # The single rank's fused parameter is the checkpoint's fused tensor, row for row.
            torch.testing.assert_close(parameter, tensors[name], rtol=0, atol=0)
            for tp_rank, model in enumerate(ranks):
                rows = torch.cat(
                    [parameter[a:b] for a, b in rank_rows(tp_rank, tp_size)[name.split(".")[-2]]]
                )
                torch.testing.assert_close(fused(model, layer)[name], rows, rtol=0, atol=0)


def test_a_fused_tensor_of_another_size_is_refused_by_name(phi3_dir: Path, tmp_path: Path) -> None:
    config = load_hf_config(phi3_dir)
    config.num_key_value_heads = 4  # the checkpoint's qkv_proj holds 2 KV heads
    model = Phi3ForCausalLM(config, torch.float32)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight: .* does not hold the 192 rows"
    ):
        model.load_weights(checkpoint.iterate_lazily(safetensors_files(phi3_dir)))
