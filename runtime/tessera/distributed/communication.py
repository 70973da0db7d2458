"""Tensor-parallel collectives. A group of one (or none) makes every call a no-op."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.distributed.parallel_state import ParallelGroup, get_tp_group


def _active(group: ParallelGroup | None) -> ParallelGroup | None:
    return group if group is not None and group.world_size > 1 else None


def tp_all_reduce(tensor: torch.Tensor, group: ParallelGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the TP group, in place; returns it."""
    active = _active(group or get_tp_group())
    if active is None:
        return tensor
    dist.all_reduce(tensor, group=active.process_group)
    return tensor


def tp_all_gather(tensor: torch.Tensor, dim: int = -1, group: ParallelGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (all ranks pass the same shape)."""
    active = _active(group or get_tp_group())
    if active is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(active.world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=active.process_group)
    return torch.cat(parts, dim=dim)


def tp_reduce_scatter(tensor: torch.Tensor, dim: int = 0, group: ParallelGroup | None = None) -> torch.Tensor:
    """Sum over the TP group and keep this rank's 1/world_size slice of ``dim`` (must divide evenly).

    gloo has no reduce-scatter, so there the sum is an all-reduce followed by a slice: the
    same result, more traffic.
    """
    active = _active(group or get_tp_group())
    if active is None:
        return tensor
    size = tensor.shape[dim]
    if size % active.world_size:
        raise ValueError(f"reduce-scatter: dim {dim} of size {size} is not divisible by {active.world_size}")
    chunk = size // active.world_size
    if dist.get_backend(active.process_group) == "gloo":
        reduced = tp_all_reduce(tensor.clone(), active)
        return reduced.narrow(dim, active.rank_in_group * chunk, chunk).contiguous()
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((chunk, *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_tensor(out, moved, group=active.process_group)
    return out.movedim(0, dim)
