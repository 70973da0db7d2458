"""The engine core: scheduler + executor, one step at a time.

In-process for the offline ``LLM``; wrapped in its own busy-loop process for serving.
"""

from __future__ import annotations

import time

from tessera.config import EngineConfig
from tessera.core.request import Request
from tessera.core.scheduler import Scheduler
from tessera.engine.messages import EngineCoreOutputs, EngineCoreRequest
from tessera.executor import make_executor
from tessera.models.registry import resolve_model


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.executor = make_executor(config, self.model_dir)
        self.max_model_len = self.executor.max_model_len
        self.scheduler = Scheduler(config, self.executor.num_kv_blocks, self.max_model_len)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        outputs = []
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            runner_output = self.executor.execute_model(scheduler_output)
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()
        )

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
