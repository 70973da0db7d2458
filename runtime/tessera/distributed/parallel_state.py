"""Process groups of this rank: the world, its tensor-parallel group, and its pipeline neighbours.

The layers never read ranks from here (they receive ``tp_rank`` / ``tp_size`` when built, so
a model can be built and tested for any rank in one process); only the collectives in
``communication.py`` and the stage-to-stage transfers in ``pipeline.py`` look up their group.
Until ``init_distributed`` runs, every group is this process alone and every collective a no-op.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch

from tessera.topology import Topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelGroup:
    """One torch.distributed group as this rank sees it."""

    ranks: tuple[int, ...]  # global ranks, in group order
    rank_in_group: int
    process_group: Any = None  # torch.distributed.ProcessGroup; None for a group of one

    @property
    def world_size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class PipelinePeers:
    """Where this rank's activations come from and go to: the same TP rank of the neighbour stages."""

    prev_rank: int | None
    next_rank: int | None


_TP_GROUP: ParallelGroup | None = None
_PIPELINE = PipelinePeers(None, None)


def set_tp_group(group: ParallelGroup | None) -> None:
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group() -> ParallelGroup | None:
    """The tensor-parallel group, or None when TP is 1 (every collective is then a no-op)."""
    return _TP_GROUP


def get_tp_world_size() -> int:
    return 1 if _TP_GROUP is None else _TP_GROUP.world_size


def get_tp_rank() -> int:
    return 0 if _TP_GROUP is None else _TP_GROUP.rank_in_group


def get_pipeline_peers() -> PipelinePeers:
    return _PIPELINE


def backend_for(device: torch.device) -> str:
    """NCCL between CUDA devices, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(topology: Topology, device: torch.device, timeout_s: float) -> None:
    """Join the group's world (rendezvous at the leader) and build this rank's groups.

    Every rank creates every TP group in the same order: ``new_group`` is collective over the
    world even for groups a rank is not in. ``timeout_s`` bounds every collective, so a peer
    that died or hangs makes the next one raise instead of blocking forever.
    """
    global _PIPELINE
    import torch.distributed as dist

    tp, pp, rank = topology.tp_size, topology.pp_size, topology.rank
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend_for(device),
        init_method=f"tcp://{topology.leader_addr}:{topology.dist_port}",
        rank=rank,
        world_size=topology.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    for stage in range(pp):
        ranks = tuple(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(list(ranks), timeout=timeout) if tp > 1 else None
        if stage == topology.pp_rank:
            set_tp_group(ParallelGroup(ranks, topology.tp_rank, group) if tp > 1 else None)
    stage = topology.pp_rank
    _PIPELINE = PipelinePeers(
        prev_rank=rank - tp if stage > 0 else None,
        next_rank=rank + tp if stage < pp - 1 else None,
    )
    logger.info(
        "rank %d/%d joined (%s): stage %d/%d, TP rank %d/%d",
        rank, topology.world_size, backend_for(device), stage, pp, topology.tp_rank, tp,
    )  # fmt: skip


def destroy_distributed() -> None:
    global _PIPELINE
    import torch.distributed as dist

    set_tp_group(None)
    _PIPELINE = PipelinePeers(None, None)
    if dist.is_initialized():
        dist.destroy_process_group()
