"""All of one rank in the engine core's own process (TP=1, PP=1)."""

from __future__ import annotations

from pathlib import Path

from tessera.config import EngineConfig
from tessera.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tessera.executor.base import Executor
from tessera.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.worker = Worker(config, model_dir)
        self.max_model_len = self.worker.max_model_len
        self.num_kv_blocks = self.worker.determine_num_blocks()
        self.worker.init_kv_cache(self.num_kv_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
