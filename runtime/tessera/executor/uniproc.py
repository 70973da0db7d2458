"""All of one rank in the engine core's own process (TP=1, PP=1)."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tessera.config import EngineConfig
from tessera.executor.base import Executor
from tessera.wire.sched_output import ModelRunnerOutput, SchedulerOutput
from tessera.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.worker = Worker(config, model_dir)
        self.max_model_len = self.worker.max_model_len
        self.initialize_kv_cache(config)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self.worker.execute_model(scheduler_output)
        assert output is not None  # the only rank is the output rank
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future
