"""Executors: how the engine core runs its ranks (see base.py)."""

from __future__ import annotations

import os
from pathlib import Path

from tessera.config import EngineConfig
from tessera.executor.base import Executor
from tessera.topology import Topology


def make_executor(config: EngineConfig, model_dir: Path) -> Executor:
    """In-process for one rank; in a pod (the topology environment is set), the other ranks are
    pods that join over TCP; otherwise every rank is a local process. Rank processes resolve the
    model themselves: a pod cannot see the folder the leader's own pod converted it into."""
    if config.world_size == 1:
        from tessera.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, model_dir)
    from tessera.executor.distributed import MultiprocExecutor, RemoteRanksExecutor

    if "TESSERA_RANK" in os.environ:
        return RemoteRanksExecutor(config, Topology.from_env(os.environ))
    return MultiprocExecutor(config)
