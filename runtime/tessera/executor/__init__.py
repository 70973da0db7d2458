"""Executors: how the engine core runs its ranks."""

from __future__ import annotations

from pathlib import Path

from tessera.config import EngineConfig
from tessera.executor.base import Executor


def make_executor(config: EngineConfig, model_dir: Path) -> Executor:
    if config.world_size == 1:
        from tessera.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, model_dir)
    raise NotImplementedError(
        f"tensor_parallel_size={config.tensor_parallel_size} x pipeline_parallel_size="
        f"{config.pipeline_parallel_size}: multi-rank execution is not available in this build yet"
    )
