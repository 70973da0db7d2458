"""A GPU rank's KV cache is what a profiled step of the largest batch leaves of its share of the
device (vLLM's sizing). The flow runs here on CPU with the device's numbers stood in for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config import EngineConfig
from tessera.executor.kv_sizing import bytes_per_block, kv_cache_budget, profile_batch
from tessera.executor.uniproc import UniProcExecutor
from tessera.worker.memory_profile import MemoryProfile
from tessera.worker.worker import Worker

GIB = 2**30


def test_the_profile_batch_is_the_largest_one_step_carries_every_request_sampled() -> None:
    config = EngineConfig(model="m", max_num_batched_tokens=64, max_num_seqs=8, block_size=4)
    batch, num_blocks = profile_batch(config, max_model_len=128)
    assert [len(s.token_ids) for s in batch.scheduled] == [8] * 8 and all(s.sample for s in batch.scheduled)
    assert num_blocks == 8 * 3  # 8 prompt tokens and the sampled one, in blocks of 4
    # One sequence at most: one prompt, as long as the context lets it be.
    alone, blocks = profile_batch(config.model_copy(update={"max_num_seqs": 1}), max_model_len=32)
    assert [len(s.token_ids) for s in alone.scheduled] == [31] and blocks == 8


def test_the_cache_gets_the_devices_share_less_weights_a_steps_peak_and_memory_outside_torch() -> None:
    profile = MemoryProfile(weights=3 * GIB, step_peak=GIB, outside_torch=GIB)
    assert kv_cache_budget(profile, total=10 * GIB, utilization=0.9, num_layers=25) == int(4 * GIB / 1.05)
    assert kv_cache_budget(profile, total=5 * GIB, utilization=0.9, num_layers=25) == 0


class StandInMemory:
    """The device's numbers in the order a profile reads them (allocated: with the profile's
    cache, then after it is freed)."""

    def __init__(self) -> None:
        self.allocations = [GIB + GIB // 2, GIB]
        self.calls: list[str] = []

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def allocated(self) -> int:
        return self.allocations.pop(0)

    def peak(self) -> int:
        self.calls.append("peak")
        return 2 * GIB + GIB // 2  # the step took 1 GiB on top

    def reserved(self) -> int:
        return 2 * GIB

    def free_and_total(self) -> tuple[int, int]:
        return 6 * GIB, 10 * GIB  # 4 GiB used: 2 of them outside torch

    def release_cached(self) -> None:
        self.calls.append("release_cached")


def test_a_profiled_rank_runs_the_batch_forgets_it_and_sizes_its_cache_by_what_is_left(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir), device="cpu", num_threads=1, max_model_len=128, block_size=8
    )
    config = config.model_copy(
        update={"max_num_batched_tokens": 96, "max_num_seqs": 4, "gpu_memory_utilization": 0.5}
    )
    threads = torch.get_num_threads()
    try:
        worker = Worker(config, tiny_llama_dir)
    finally:
        torch.set_num_threads(threads)
    worker.runner.memory = StandInMemory()  # a GPU's numbers, on this CPU
    steps: list[list[int]] = []
    execute = worker.runner.execute_model

    def recorded(scheduler_output, *args, **kwargs):  # type: ignore[no-untyped-def]
        steps.append([len(s.token_ids) for s in scheduler_output.scheduled])
        return execute(scheduler_output, *args, **kwargs)

    monkeypatch.setattr(worker.runner, "execute_model", recorded)
    executor = UniProcExecutor.__new__(UniProcExecutor)
    executor.worker, executor.max_model_len = worker, worker.max_model_len
    num_blocks = executor.initialize_kv_cache(config)

    assert steps == [[24, 24, 24, 24]]  # the largest batch: 96 tokens over 4 sampled requests
    assert worker.runner.memory.calls == ["reset_peak", "peak", "release_cached"]
    assert worker.runner.memory_profile == MemoryProfile(weights=GIB, step_peak=GIB, outside_torch=2 * GIB)
    assert not worker.runner.requests and not worker.runner.failed  # the profile's requests are gone
    num_layers = worker.runner.model.kv_cache_spec[0]
    budget = int((5 * GIB - 4 * GIB) / (1 + 1.25 / num_layers))
    assert (
        num_blocks
        == budget // bytes_per_block(worker.runner.kv_cache_facts(), config.block_size)
        == worker.runner.kv_caches[0].shape[1]
    )


def test_a_cpu_rank_or_a_given_size_is_not_profiled(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_threads=1, max_model_len=128)
    threads = torch.get_num_threads()
    try:
        worker = Worker(config, tiny_llama_dir)
    finally:
        torch.set_num_threads(threads)
    assert not worker.needs_memory_profile()
    worker.runner.memory = StandInMemory()
    assert worker.needs_memory_profile()
    sized = config.model_copy(update={"kv_cache_memory": 1 << 20})
    worker.runner.config = sized
    assert not worker.needs_memory_profile()
