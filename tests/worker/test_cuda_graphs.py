"""Decode CUDA graphs: which sizes are captured, which batches replay, and the static-buffer data
path a graph records, on CPU (the capture itself needs CUDA: benchmarks/gpu_check.py runs it)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tessera import kernels
from tessera.config import EngineConfig
from tessera.models.layers import triton_attention
from tessera.models.loader import load_model
from tessera.wire.sched_output import ScheduledRequest
from tessera.worker.cuda_graphs import DecodeGraphs, capture_sizes, padded_size, why_eager
from tessera.worker.model_runner import step_inputs
from tests.fixtures.models import make_tiny_model_dir
from tests.kernels.triton_interpreter import interpreted_kernels

__all__ = ["interpreted_kernels"]

torch.set_num_threads(2)
CPU = torch.device("cpu")
BLOCK_SIZE = 4


def _config(**fields: Any) -> EngineConfig:
    return EngineConfig(model="unused", **fields)


def test_capture_sizes_follow_vllm_up_to_the_largest_batch() -> None:
    assert capture_sizes(_config(max_num_seqs=128)) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(_config(max_num_seqs=20)) == [1, 2, 4, 8, 16, 24]  # 20 decodes pad to 24
    assert capture_sizes(_config(max_num_seqs=3)) == [1, 2, 4]
    assert capture_sizes(_config(max_num_seqs=4096, max_num_batched_tokens=8192))[-1] == 512
    assert capture_sizes(_config(max_num_seqs=64, max_num_batched_tokens=16)) == [1, 2, 4, 8, 16]
    assert capture_sizes(_config(cuda_graph_sizes=[8, 1, 8, 3])) == [1, 3, 8]
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        _config(cuda_graph_sizes=[0, 4])


def test_padded_size_is_the_smallest_that_holds_the_batch() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 16, 17)] == [1, 2, 4, 8, 8, 16, 16, None]


def test_eager_when_asked_or_off_a_single_cuda_rank() -> None:
    assert why_eager(_config(enforce_eager=True), torch.device("cuda", 0)) == "enforce_eager is set"
    assert "cpu" in str(why_eager(_config(), CPU))


def _request(name: str, tokens: list[int], start: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=name, token_ids=tokens, start_position=start, block_ids=blocks, sample=True
    )


def _forward(model: Any, batch: list[ScheduledRequest], caches: list[torch.Tensor]) -> torch.Tensor:
    input_ids, positions, metadata = step_inputs(batch, BLOCK_SIZE, CPU)
    return model.compute_logits(model(input_ids, positions, caches, metadata))


@pytest.mark.parametrize("max_model_len", [64, 1024], ids=["one-partition", "split-context"])
def test_static_buffers_give_the_eager_forward(
    interpreted_kernels: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_model_len: int
) -> None:
    """Not a test of CUDA graphs (none exist on CPU) but of the buffer plumbing a graph records: a
    decode batch copied into the static inputs of a larger size, the forward run on those buffers
    as the capture runs it (Triton backend, interpreted) and its real rows taken give the eager
    forward's logits, and the padding rows write nothing into the KV cache. At 1024 tokens the
    context split is planned for max_model_len: four partitions, the later ones empty."""
    monkeypatch.setattr(triton_attention, "SELECTED", "triton")
    monkeypatch.setattr(kernels, "ENABLED", False)
    model = load_model(make_tiny_model_dir(tmp_path, num_layers=2), dtype=torch.float32, device=CPU)
    layers, kv_heads, head_dim = model.kv_cache_spec
    # Random, not zeros: a padding row writing (token 0 may embed to zeros) would show.
    caches = [torch.randn(2, 32, BLOCK_SIZE, kv_heads, head_dim) for _ in range(layers)]
    prompts = {"a": ([5, 9, 13, 2, 7], [3, 8]), "b": (list(range(20, 29)), [1, 4, 6]), "c": ([40, 41], [11])}
    with torch.inference_mode():
        _forward(
            model, [_request(name, tokens, 0, blocks) for name, (tokens, blocks) in prompts.items()], caches
        )
        decodes = [
            _request(name, [100 + i], len(tokens), blocks + [20 + i] * (len(tokens) % BLOCK_SIZE == 0))
            for i, (name, (tokens, blocks)) in enumerate(prompts.items())
        ]
        eager_caches = copy.deepcopy(caches)
        expected = _forward(model, decodes, eager_caches)

        graphs = DecodeGraphs(model, caches, [1, 2, 4], max_model_len, BLOCK_SIZE, CPU)
        assert graphs.fits(decodes)
        before = copy.deepcopy(caches)
        input_ids, positions, metadata = step_inputs(decodes, BLOCK_SIZE, CPU)
        graphs.inputs.load(4, input_ids, positions, metadata)
        logits = model.compute_logits(graphs.forward_on_inputs(4)[: len(decodes)])

    assert (logits - expected).abs().max().item() < 1e-5
    written = metadata.slot_mapping
    for ours, eager, old in zip(caches, eager_caches, before, strict=True):
        ours_slots, eager_slots, old_slots = (c.view(2, -1, kv_heads * head_dim) for c in (ours, eager, old))
        assert torch.allclose(ours_slots[:, written], eager_slots[:, written], atol=1e-6)
        untouched = torch.ones(ours_slots.shape[1], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(ours_slots[:, untouched], old_slots[:, untouched])  # padding wrote nothing


def test_prefills_and_oversized_batches_run_eagerly() -> None:
    graphs = DecodeGraphs(None, [], [1, 2], 64, BLOCK_SIZE, CPU)
    decode = _request("d", [1], 3, [0])
    assert graphs.fits([decode, decode])
    assert not graphs.fits([decode, decode, decode])  # no size holds three
    assert not graphs.fits([decode, _request("p", [1, 2], 0, [1])])  # a prefill in the batch
    assert not graphs.fits([_request("long", [1], 70, list(range(18)))])  # wider than max_model_len
