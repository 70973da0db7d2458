"""Tensor-parallel collectives. A group of one (or none) makes every call a no-op.

Every call is timed into ``COMM_STATS`` (the benchmark reports communication's share of a
step). On CUDA the timings cover only the launch of asynchronous NCCL work.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from tessera.distributed.parallel_state import ParallelGroup, get_tp_group


@dataclass
class CommStats:
    """Cumulative communication of this rank since it started (or since ``reset``)."""

    collective_seconds: float = 0.0
    collective_calls: int = 0
    p2p_seconds: float = 0.0
    p2p_bytes_sent: int = 0
    p2p_bytes_received: int = 0
    # Expert parallelism's all-to-all exchanges (layers/expert_parallel.py): bytes this rank sent
    # to other ranks, and the (token, expert) rows among them: dispatched to the experts' ranks,
    # and returned to the tokens' ranks as expert outputs; exchanges: MoE layer calls.
    all_to_all_bytes_sent: int = 0
    expert_exchanges: int = 0
    expert_rows_dispatched: int = 0
    expert_rows_returned: int = 0

    def reset(self) -> None:
        for name, value in asdict(CommStats()).items():
            setattr(self, name, value)

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


COMM_STATS = CommStats()


def _active(group: ParallelGroup | None) -> ParallelGroup | None:
    return group if group is not None and group.world_size > 1 else None


def padded_rows(num_rows: int, tp_size: int) -> int:
    """Token rows padded to a multiple of the TP size (sequence parallelism shards them evenly)."""
    return -(-num_rows // tp_size) * tp_size


def pad_rows(tensor: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``num_rows`` (itself when already that long)."""
    missing = num_rows - tensor.shape[0]
    if missing == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((missing, *tensor.shape[1:]))])


def tp_all_reduce(tensor: torch.Tensor, group: ParallelGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the TP group, in place; returns it."""
    active = _active(group or get_tp_group())
    if active is None:
        return tensor
    started = time.perf_counter()
    dist.all_reduce(tensor, group=active.process_group)
    _count(started)
    return tensor


def tp_all_gather(tensor: torch.Tensor, dim: int = -1, group: ParallelGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (all ranks pass the same shape)."""
    active = _active(group or get_tp_group())
    if active is None:
        return tensor
    started = time.perf_counter()
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * active.world_size, *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=active.process_group)
    _count(started)
    return out.movedim(0, dim)


def tp_reduce_scatter(tensor: torch.Tensor, dim: int = 0, group: ParallelGroup | None = None) -> torch.Tensor:
    """Sum over the TP group and keep this rank's 1/world_size slice of ``dim`` (must divide evenly)."""
    active = _active(group or get_tp_group())
    if active is None:
        return tensor
    size = tensor.shape[dim]
    if size % active.world_size:
        raise ValueError(f"reduce-scatter: dim {dim} of size {size} is not divisible by {active.world_size}")
    started = time.perf_counter()
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((size // active.world_size, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=active.process_group)
    _count(started)
    return out.movedim(0, dim)


def tp_all_to_all(
    tensor: torch.Tensor,
    send_rows: list[int],
    receive_rows: list[int],
    group: ParallelGroup | None = None,
) -> torch.Tensor:
    """Send ``send_rows[r]`` consecutive rows of ``tensor`` to TP rank r, and receive
    ``receive_rows[r]`` rows from each rank r, concatenated in rank order (gloo and NCCL both run
    ``all_to_all_single`` with uneven splits). Counts the bytes sent to other ranks."""
    active = _active(group or get_tp_group())
    if active is None:
        return tensor
    started = time.perf_counter()
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(receive_rows), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor, receive_rows, send_rows, group=active.process_group)
    _count(started)
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    others = sum(rows for rank, rows in enumerate(send_rows) if rank != active.rank_in_group)
    COMM_STATS.all_to_all_bytes_sent += others * row_bytes
    return out


def _count(started: float) -> None:
    COMM_STATS.collective_seconds += time.perf_counter() - started
    COMM_STATS.collective_calls += 1
