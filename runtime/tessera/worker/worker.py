"""One rank: picks its device and thread count, owns a model runner and its KV cache."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tessera.config import EngineConfig
from tessera.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tessera.worker.model_runner import ModelRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def select_device(config: EngineConfig, local_rank: int = 0) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def select_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        # CPUs here run fp32 matmuls fastest; accelerators run bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def default_num_threads(local_world_size: int = 1) -> int:
    return max(1, (os.cpu_count() or 1) // local_world_size)


class Worker:
    def __init__(
        self, config: EngineConfig, model_dir: Path, local_rank: int = 0, local_world_size: int = 1
    ) -> None:
        self.device = select_device(config, local_rank)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or default_num_threads(local_world_size))
        else:
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, model_dir, self.device, select_dtype(config, self.device))

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
