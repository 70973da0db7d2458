"""One process at a group's rendezvous: a rank (``rank R SECRET``) joins through
``parallel_state.init_distributed``, all-reduces its rank + 1 and prints the sum; a stranger
(``stranger PREFIX``) connects to the same store and tries to join as rank 1 under a guessed key
prefix ("" for none), printing what happened. Run with ``python -m tests.distributed.rendezvous_peer``
and TESSERA_DIST_PORT set."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from tessera.distributed import parallel_state
from tessera.distributed.group_secret import GroupKeys
from tessera.topology import ParallelLayout, Topology

TIMEOUT_S = float(os.environ.get("RENDEZVOUS_TIMEOUT_S", "20"))


def main() -> None:
    role, port = sys.argv[1], int(os.environ["TESSERA_DIST_PORT"])
    if role == "rank":
        rank, secret = int(sys.argv[2]), sys.argv[3].encode()
        topology = Topology(layout=ParallelLayout(tensor_parallel_size=2), tp_rank=rank, dist_port=port)
        parallel_state.init_distributed(topology, torch.device("cpu"), TIMEOUT_S, GroupKeys(secret))
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        print(f"sum {value.item():.0f}", flush=True)
        parallel_state.destroy_distributed()
        return
    prefix = sys.argv[2]
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store: dist.Store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
    if prefix:
        store = dist.PrefixStore(prefix, store)
    try:
        dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timeout)
        value = torch.tensor([100.0])
        dist.all_reduce(value)
        print(f"joined {value.item():.0f}", flush=True)
    except Exception as exc:
        print(f"refused {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
