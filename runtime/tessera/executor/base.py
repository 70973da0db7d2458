"""How the engine core reaches its ranks: one interface, one implementation per way of running them.

- ``uniproc.UniProcExecutor``: world size 1, the rank runs in the engine core's own process.
- ``distributed.MultiprocExecutor``: every rank is a local process (`tessera serve --tp T --pp P`).
- ``distributed.RemoteRanksExecutor``: rank 0 is local, the others are pods Kubernetes started,
  which join over TCP (the topology contract tells each where its leader is).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from tessera.config import EngineConfig
from tessera.executor.kv_sizing import decide_num_blocks, profile_batch
from tessera.wire.sched_output import ModelRunnerOutput, SchedulerOutput
from tessera.worker.memory_profile import KVCacheFacts
from tessera.worker.worker import STEP_TIMEOUT_S


class ExecutorFailedError(RuntimeError):
    """A rank died, hung or misbehaved: the engine cannot go on."""


class Executor(ABC):
    max_model_len: int
    num_kv_blocks: int
    # Batches the engine core may keep in flight: one per pipeline stage.
    max_concurrent_batches: int = 1

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call ``method(*args)`` on every rank's worker; their results in rank order."""

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step on every rank; the output (or, with ``non_block``, a future of it)."""

    def wait(self, future: Future[ModelRunnerOutput]) -> ModelRunnerOutput:
        """The output of a step submitted with ``non_block``; ExecutorFailedError when none comes."""
        try:
            return future.result(timeout=STEP_TIMEOUT_S)
        except TimeoutError:
            raise ExecutorFailedError(f"a step got no answer in {STEP_TIMEOUT_S:.0f} s") from None

    def initialize_kv_cache(self, config: EngineConfig) -> int:
        """Every rank's cache, as many blocks as the smallest can hold (kv_sizing.py decides).
        GPU ranks first run one step of the largest batch on a cache made for it alone
        (memory_profile.py): what they measure is then what is left after such a step."""
        if any(self.collective_rpc("needs_memory_profile")):
            batch, num_blocks = profile_batch(config, self.max_model_len)
            self.collective_rpc("begin_memory_profile", (num_blocks,))
            self.execute_model(batch)
            self.collective_rpc("end_memory_profile")
        ranks = [KVCacheFacts(**facts) for facts in self.collective_rpc("kv_cache_facts")]
        self.num_kv_blocks = decide_num_blocks(config, ranks, self.max_model_len)
        self.collective_rpc("init_kv_cache", (self.num_kv_blocks,))
        return self.num_kv_blocks

    def check_health(self) -> None:  # noqa: B027 - optional hook
        """Raise ExecutorFailedError when a rank is gone (called while the engine is idle too)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass
