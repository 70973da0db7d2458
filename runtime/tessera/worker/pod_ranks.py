"""A worker pod that runs several ranks (TESSERA_LOCAL_RANKS: a stage's whole TP group): its
`tessera worker` starts one rank process per rank and supervises them.

Each process gets its own rank's topology and LOCAL_RANK = its index in the pod (its device,
cuda:<index>), and joins the leader over TCP like any pod rank, with the pod's group secret.
The pod lives and dies as one: a rank that exits takes the others down and the pod exits
non-zero (the operator restarts the group as a whole), and the kubelet's SIGTERM reaches every
rank. The leader pod needs none of this: its engine core starts and watches its local ranks.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Mapping
from types import FrameType

from tessera.distributed.group_secret import secret_file
from tessera.topology import Topology
from tessera.worker.rank_launch import rank_env, start_rank

logger = logging.getLogger("tessera.worker")

POLL_S = 0.1
# A clean stop (the leader's SHUTDOWN) reaches every rank at once: the others follow within this.
# A rank that exits alone past it has left its stage's TP group broken.
SIBLING_EXIT_GRACE_S = 10.0
# Ranks told to stop (SIGTERM) that are still there this long after are killed.
STOP_GRACE_S = 5.0


def run_pod_ranks(topology: Topology, ranks: list[int], environ: Mapping[str, str], rpc_addr: str) -> int:
    """Start ``ranks`` (this pod's, its first rank's topology given), watch them; the pod's exit status."""
    secret = secret_file(environ)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    stopping: list[int] = []

    def stop_ranks(signum: int, _frame: FrameType | None) -> None:
        # SIGTERM for a Ctrl-C too: ranks started by a parent ignore SIGINT (see worker_proc).
        stopping.append(signum)
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()

    signal.signal(signal.SIGTERM, stop_ranks)
    signal.signal(signal.SIGINT, stop_ranks)
    for index, rank in enumerate(ranks):
        env = rank_env(environ, topology.for_rank(rank), index, len(ranks), rpc_addr, secret)
        procs[rank] = start_rank(env)
    if stopping:  # told to stop while the ranks started: the later ones missed it
        stop_ranks(stopping[0], None)
    logger.info("pod of ranks %s: started as pids %s", ranks, [p.pid for p in procs.values()])
    try:
        return _supervise(procs)
    finally:
        _stop(procs)


def _supervise(procs: dict[int, subprocess.Popen[bytes]]) -> int:
    first_clean_exit: float | None = None
    while True:
        codes = {rank: proc.poll() for rank, proc in procs.items()}
        failed = [(rank, code) for rank, code in codes.items() if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            assert code is not None
            logger.error("rank %d exited with status %d: stopping this pod's other ranks", rank, code)
            return code if code > 0 else 128 - code  # killed by a signal: the shell's 128 + N
        if all(code == 0 for code in codes.values()):
            return 0
        if any(code == 0 for code in codes.values()):
            first_clean_exit = first_clean_exit or time.monotonic()
            if time.monotonic() - first_clean_exit > SIBLING_EXIT_GRACE_S:
                running = sorted(rank for rank, code in codes.items() if code is None)
                logger.error(
                    "ranks %s still run %.0f s after a sibling stopped", running, SIBLING_EXIT_GRACE_S
                )
                return 1
        time.sleep(POLL_S)


def _stop(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    """Every rank still running gets SIGTERM, then SIGKILL once STOP_GRACE_S has passed."""
    running = [proc for proc in procs.values() if proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.kill()
            proc.wait()
