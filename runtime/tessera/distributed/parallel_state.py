"""Process groups of this rank: the world, its tensor-parallel group, and its pipeline neighbours.

The layers never read ranks from here (they are built from a ``topology.RankPlacement``, so
a model can be built and tested for any rank in one process); only the collectives in
``communication.py`` and the stage-to-stage transfers in ``pipeline.py`` look up their group.
Until ``init_distributed`` runs, every group is this process alone and every collective a no-op.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from tessera.distributed.group_secret import GroupKeys
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
# Rank 0's rendezvous store (it owns, and closes, the socket it listens on).
_STORE: Any = None
# How long rank 0 retries resolving its own address (a pod's name is in its /etc/hosts at once).
RESOLVE_TIMEOUT_S = 30.0


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


def listen_socket(host: str, port: int) -> socket.socket:
    """Rank 0's rendezvous socket, bound only where its peers reach it: the address its leader
    name resolves to (loopback for local ranks; in a pod, its own address, which the pod's
    /etc/hosts gives its name). Every interface only if none of those is this machine's (the
    store's keys are still the group's alone), with a warning."""
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    while True:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
            break
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                logger.warning("rendezvous: cannot resolve %s (%s)", host, exc)
                infos = []
                break
            time.sleep(0.5)
    errors = []
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
            return sock
        except OSError as exc:
            errors.append(f"{addr[0]}: {exc.strerror or exc}")
            sock.close()
    logger.warning(
        "rendezvous: cannot listen on %s (%s); listening on every interface for port %d",
        host, "; ".join(errors) or "no address", port,
    )  # fmt: skip
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False)
    return socket.create_server(("", port))


def rendezvous_store(topology: Topology, keys: GroupKeys, timeout: datetime.timedelta) -> Any:
    """The group's rendezvous: rank 0 serves a TCPStore on ``listen_socket``; every rank sees it
    through a prefix derived from the group's secret, so a stranger connected to the store can
    neither name nor write the keys the group meets under (docs/SECURITY.md, "Rank traffic")."""
    global _STORE
    import torch.distributed as dist

    host, port = topology.leader_addr, topology.dist_port
    if topology.rank == 0:
        fd = listen_socket(host, port).detach()  # the store closes it
        try:
            # No wait_for_workers: its count of joined clients is a key of the store's own, which
            # anyone connected could move; the group's meeting is under the prefix.
            _STORE = dist.TCPStore(
                host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=fd
            )
        except BaseException:
            os.close(fd)
            raise
        store = _STORE
    else:
        store = dist.TCPStore(host, port, None, False, timeout)
    return dist.PrefixStore(keys.rendezvous_prefix, store)


def init_distributed(topology: Topology, device: torch.device, timeout_s: float, keys: GroupKeys) -> None:
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
        store=rendezvous_store(topology, keys, timeout),
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
    global _PIPELINE, _STORE
    import torch.distributed as dist

    set_tp_group(None)
    _PIPELINE = PipelinePeers(None, None)
    if dist.is_initialized():
        dist.destroy_process_group()
    _STORE = None
