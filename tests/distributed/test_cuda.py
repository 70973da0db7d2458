"""The CUDA/NCCL path: selected by device, exercised where GPUs exist, skipped (with the reason) here."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from tessera import SamplingParams
from tessera.config import EngineConfig
from tessera.distributed.parallel_state import backend_for
from tessera.topology import ParallelLayout, Topology
from tessera.worker.worker import select_device, select_dtype
from tests.distributed.equivalence import Workload, compare, run, token_prompts

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_the_device_picks_the_backend_and_the_local_rank_picks_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert select_device(EngineConfig(model="m", device="cuda"), local_rank=3) == torch.device("cuda", 3)
    assert select_device(EngineConfig(model="m", device="cpu"), local_rank=3) == torch.device("cpu")
    # A pod sees only its own GPUs: a rank past them is a clear error, not CUDA's "invalid ordinal".
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="sees 1 GPU"):
        select_device(EngineConfig(model="m", device="cuda"), local_rank=1)
    # A pod of several ranks that asked for too few devices: the message names the pod's field.
    with pytest.raises(RuntimeError, match=r"local rank 2 of the 4 ranks.*sees 1 GPU.*ranksPerPod"):
        select_device(EngineConfig(model="m", device="cuda"), local_rank=2, local_world_size=4)


@pytest.mark.parametrize(("bf16_in_hardware", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_a_gpu_is_bf16_only_where_its_hardware_has_it(
    monkeypatch: pytest.MonkeyPatch, bf16_in_hardware: bool, expected: torch.dtype
) -> None:
    asked: list[bool] = []

    def bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return bf16_in_hardware

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16_supported)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    assert select_dtype(EngineConfig(model="m"), torch.device("cuda", 0)) == expected
    assert asked == [False]  # emulated bf16 does not count
    assert select_dtype(EngineConfig(model="m"), torch.device("cpu")) == torch.float32
    assert select_dtype(EngineConfig(model="m", dtype="bfloat16"), torch.device("cuda", 0)) == torch.bfloat16


def test_every_rank_pod_uses_its_first_visible_gpu() -> None:
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2)
    for rank in range(4):
        env = Topology(layout=layout, leader_addr="leader").for_rank(rank).to_env()
        assert env["LOCAL_RANK"] == "0" and env["RANK"] == str(rank)


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices for NCCL between ranks; this machine has {GPUS}")
def test_tensor_and_pipeline_parallel_on_gpus_match_one_gpu(tiny_llama_dir: Path) -> None:
    workload = Workload(
        prompts=token_prompts(6, vocab=512, min_len=3, max_len=40),
        params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
        engine_args={"device": "cuda", "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128},
    )
    reference = run(str(tiny_llama_dir), workload)
    for layout in ({"tensor_parallel_size": 2, "sequence_parallel": True}, {"pipeline_parallel_size": 2}):
        compare(reference.outputs, run(str(tiny_llama_dir), workload, **layout).outputs, str(layout))
