"""Expert parallelism's exchange: (token, expert) rows travel to the rank holding the expert and
its outputs travel back, over two ``all_to_all_single`` calls (and one of counts before them).

Each TP rank holds a contiguous range of ``count`` experts (rank r: ``[r * count, (r + 1) *
count)``), so rows sorted by expert id are already grouped by destination rank. A rank tells
every other how many rows it sends each of that rank's experts ([count] int64 per peer), which
is what the receiver needs to group what arrives by expert. The outputs return unweighted, in
the order they were sent: the sender weights and adds them (the weights never travel).
``COMM_STATS`` counts the bytes sent to other ranks (``all_to_all_bytes_sent``: counts, rows,
outputs), the rows among them (``expert_rows_dispatched`` / ``expert_rows_returned``) and
the exchanges (``expert_exchanges``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from tessera.distributed.communication import COMM_STATS, tp_all_to_all
from tessera.models.layers.moe_timers import MOE_TIMERS


class ExpertGroup(Protocol):
    """This rank's experts (``moe.GroupedExperts``)."""

    num_experts: int
    count: int  # experts per rank
    first: int  # this rank's first expert

    def grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor: ...


def compute_on_expert_ranks(rows: torch.Tensor, counts: list[int], experts: ExpertGroup) -> torch.Tensor:
    """``rows`` sorted by expert id (``counts[e]`` for expert e, over all experts) through their
    experts wherever those live; returns the outputs in ``rows``' order."""
    per_rank = experts.count
    ranks = experts.num_experts // per_rank
    rank = experts.first // per_rank
    send = [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(ranks)]
    # received[s, e]: rows rank s sends this rank's local expert e.
    counts_out = torch.tensor(counts, dtype=torch.int64)
    received = MOE_TIMERS.run("exchange", tp_all_to_all, counts_out, [per_rank] * ranks, [per_rank] * ranks)
    received = received.view(ranks, per_rank)
    receive = received.sum(dim=1).tolist()
    arrived = MOE_TIMERS.run("exchange", tp_all_to_all, rows, send, receive)  # by (source rank, local expert)
    local_expert = torch.arange(per_rank).repeat(ranks).repeat_interleave(received.reshape(-1))
    order = torch.argsort(local_expert, stable=True)
    outputs = torch.empty_like(arrived)
    outputs[order] = MOE_TIMERS.run("experts", experts.grouped, arrived[order], received.sum(dim=0).tolist())
    COMM_STATS.expert_rows_dispatched += sum(send) - send[rank]
    COMM_STATS.expert_rows_returned += sum(receive) - receive[rank]
    COMM_STATS.expert_exchanges += 1
    return MOE_TIMERS.run("exchange", tp_all_to_all, outputs, receive, send)
