"""Process groups of this rank. Until a launcher wires them, every group is this process alone.

The layers never read ranks from here (they receive ``tp_rank`` / ``tp_size`` when built, so
a model can be built and tested for any rank in one process); only the collectives in
``communication.py`` look up the group they run over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelGroup:
    """One torch.distributed group as this rank sees it."""

    ranks: tuple[int, ...]  # global ranks, in group order
    rank_in_group: int
    process_group: Any = None  # torch.distributed.ProcessGroup; None for a group of one

    @property
    def world_size(self) -> int:
        return len(self.ranks)


_TP_GROUP: ParallelGroup | None = None


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
