"""How the engine core reaches its ranks: one interface, one implementation per way of running them."""

from __future__ import annotations

from abc import ABC, abstractmethod

from tessera.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    max_model_len: int
    num_kv_blocks: int

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass
