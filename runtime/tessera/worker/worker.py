"""One rank: picks its device and thread count, joins its process groups, owns a model runner.

The same class serves the in-process executor (world size 1) and the worker processes of
the multi-rank executors (``worker_proc.py``). Between pipeline stages it moves activations:
a stage other than the first receives the previous stage's output before running its layers,
a stage other than the last sends its output on and returns nothing. Only the last stage's
TP rank 0 returns sampled tokens.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from tessera.config import EngineConfig
from tessera.distributed import pipeline
from tessera.distributed.communication import COMM_STATS
from tessera.distributed.group_secret import GroupKeys
from tessera.distributed.intermediate_tensors import IntermediateTensors
from tessera.distributed.parallel_state import destroy_distributed, init_distributed
from tessera.host import PROCESS_CPUS, cgroup_cpu_limit
from tessera.models.layers.moe_timers import MOE_TIMERS
from tessera.models.registry import resolve_model
from tessera.topology import Topology
from tessera.wire.sched_output import ModelRunnerOutput, SchedulerOutput
from tessera.worker.cpu_binding import bind_threads
from tessera.worker.cpu_memory import retain_freed_memory
from tessera.worker.model_runner import ModelRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Bounds every collective and stage-to-stage transfer: a peer that died or hangs makes the
# next one raise (gloo) or NCCL's watchdog end the process (NCCL), instead of blocking forever;
# the leader's heartbeats usually notice first, and then the rank's silence.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TESSERA_COLLECTIVE_TIMEOUT", "120"))
# A step of the largest batches takes seconds; minutes without an answer means a hung rank. A
# later pipeline stage waits this long for the stage before it, whose whole share of the step
# it waits through (the collective limit is for peers that compute side by side).
STEP_TIMEOUT_S = float(os.environ.get("TESSERA_STEP_TIMEOUT", "300"))


def select_device(config: EngineConfig, local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise RuntimeError(
                f"local rank {local_rank} of the {local_world_size} ranks here needs cuda:{local_rank}, "
                f"but this process sees {visible} GPU(s): more ranks than devices. Give each rank its own "
                "GPU: a pod of several ranks (TESSERA_LOCAL_RANKS, an InferenceCluster's "
                "spec.template.ranksPerPod) requests gpusPerRank x ranksPerPod of them; elsewhere "
                "CUDA_VISIBLE_DEVICES names them"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def select_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        if device.type != "cuda":
            return torch.float32  # CPUs here run fp32 matmuls fastest
        # GPUs run bf16 where their tensor cores do (compute capability 8.0 on), else fp16 (vLLM's
        # choice too): emulated bf16 on a T4 or V100 is many times slower.
        with torch.cuda.device(device):
            return (
                torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
            )
    return DTYPES[config.dtype]


def default_num_threads(local_world_size: int = 1) -> int:
    """OMP_NUM_THREADS when set (e.g. a pod's env), else this process's share of the cores it may
    run on: its affinity mask, capped by its container's CPU limit."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cpus = len(PROCESS_CPUS)
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, limit)
    return max(1, cpus // local_world_size)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path | None,
        topology: Topology | None = None,
        local_rank: int = 0,
        local_world_size: int = 1,
        group_keys: GroupKeys | None = None,
    ) -> None:
        self.topology = topology or Topology(layout=config.parallel)
        self.device = select_device(config, local_rank, local_world_size)
        self.pinned_cpus: list[int] | None = None
        if self.device.type == "cpu":
            threads = config.num_threads or default_num_threads(local_world_size)
            torch.set_num_threads(threads)
            self.pinned_cpus = bind_threads(config.cpu_binding, threads, local_rank, local_world_size)
            if config.retain_freed_memory:
                retain_freed_memory()
        else:
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        self.distributed = self.topology.world_size > 1
        if self.distributed:
            # Only holders of the group's secret meet in the rendezvous (default: the file the
            # environment names, as for the rank channel).
            keys = group_keys or GroupKeys.from_env(os.environ)
            init_distributed(self.topology, self.device, COLLECTIVE_TIMEOUT_S, keys)
        if model_dir is None:
            # A rank process resolves its own copy (an alias or .gguf converts into this pod's
            # cache), after the rendezvous: a slow conversion is then bounded by the leader's
            # start-up timeout, not by the rendezvous' collective timeout.
            model_dir = resolve_model(config.model)
        self.runner = ModelRunner(
            config, model_dir, self.device, select_dtype(config, self.device), self.topology
        )
        self.is_first_stage = self.topology.pp_rank == 0
        self.is_last_stage = self.topology.is_last_stage
        # The one rank whose sampled tokens go back to the engine core.
        self.is_output_rank = self.is_last_stage and self.topology.tp_rank == 0
        self.sender = pipeline.PipelineSender()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def needs_memory_profile(self) -> bool:
        return self.runner.needs_memory_profile()

    def begin_memory_profile(self, num_blocks: int) -> None:
        self.runner.begin_memory_profile(num_blocks)

    def end_memory_profile(self) -> None:
        self.runner.end_memory_profile()

    def kv_cache_facts(self) -> dict[str, int | bool | None]:
        """What the KV sizing needs of this rank, as builtins (it crosses the rank channel)."""
        return dataclasses.asdict(self.runner.kv_cache_facts())

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput, step_id: int = 0) -> ModelRunnerOutput | None:
        model, runner = self.runner.model, self.runner

        def receive(num_tokens: int) -> IntermediateTensors:
            rows = model.intermediate_rows(num_tokens)
            hidden_size = model.config.hidden_size
            return pipeline.receive(step_id, rows, hidden_size, runner.dtype, self.device, STEP_TIMEOUT_S)

        receive_fn = None if self.is_first_stage else receive
        result = runner.execute_model(scheduler_output, receive_fn, sample=self.is_output_rank)
        if isinstance(result, IntermediateTensors):
            self.sender.send(result, step_id)
            return None
        return result if self.is_output_rank else None

    def comm_stats(self) -> dict[str, Any]:
        return {
            "rank": self.topology.rank,
            **COMM_STATS.snapshot(),
            **MOE_TIMERS.snapshot(),
            **self.runner.step_stats(),
        }

    def reset_comm_stats(self) -> None:
        COMM_STATS.reset()
        MOE_TIMERS.reset()
        self.runner.reset_step_stats()

    def shutdown(self) -> None:
        if self.distributed:
            self.sender.flush()
            destroy_distributed()
