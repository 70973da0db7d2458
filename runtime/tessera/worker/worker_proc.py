"""One rank's process, the same for local ranks and for pods: `tessera worker`.

(In a pod that runs several ranks, TESSERA_LOCAL_RANKS, `tessera worker` starts one such process
per rank and supervises them: ``pod_ranks``.)

topology (from the environment) -> connect to the leader -> receive the engine configuration
-> device and threads -> process groups -> load this rank's shards -> READY -> serve calls and
steps until SHUTDOWN. Any failure is reported to the leader (FATAL) and exits non-zero; a
leader that goes silent makes the process exit non-zero too (see ``rpc.WorkerLink``).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import traceback
from typing import Any

from tessera.topology import GROUP_SECRET_FILE_ENV, Topology, TopologyError
from tessera.worker.rank_launch import LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV, PARENT_PID_ENV, RPC_ADDR_ENV

logger = logging.getLogger("tessera.worker")

# Where a leader makes its local ranks' socket folder (default: the temporary folder).
RANKS_IPC_PARENT_ENV = "TESSERA_RANKS_IPC_PARENT"
# How long a leader waits for its ranks to join and load, and a rank for its leader: pods may
# still be scheduled, pulling images or converting the model. A rank pod may start long before
# its leader; past this it gives up and exits 1.
RANK_STARTUP_TIMEOUT_S = float(os.environ.get("TESSERA_RANK_STARTUP_TIMEOUT", "900"))
# The same for rank processes the leader starts on its own machine (`--tp/--pp`).
LOCAL_STARTUP_TIMEOUT_S = float(os.environ.get("TESSERA_LOCAL_STARTUP_TIMEOUT", "600"))
# The only worker methods the leader may call (the RPC port is reachable from the network).
CALLABLE = frozenset(
    {
        "needs_memory_profile",
        "begin_memory_profile",
        "end_memory_profile",
        "kv_cache_facts",
        "init_kv_cache",
        "comm_stats",
        "reset_comm_stats",
    }
)


def leader_rpc_addr(topology: Topology, environ: dict[str, str] | os._Environ[str]) -> str:
    return environ.get(RPC_ADDR_ENV) or f"tcp://{topology.leader_addr}:{topology.rpc_port}"


def run_worker(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """The rank process's life; returns its exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [rank] %(message)s")
    try:
        topology = Topology.from_env(environ)
        local_ranks = topology.local_ranks(environ)
    except TopologyError as exc:
        logger.error("invalid topology environment: %s", exc)
        return 2
    from tessera.distributed import rpc
    from tessera.distributed.group_secret import GroupKeys, GroupSecretError
    from tessera.worker import cpu_binding

    try:
        keys = GroupKeys.from_env(environ)
    except GroupSecretError as exc:  # no secret, no way in: say which file, and how to name another
        logger.error("rank %d cannot join its leader: %s", topology.rank, exc)
        return 2
    if len(local_ranks) > 1:  # a pod of several ranks: this process only starts and watches them
        from tessera.worker.pod_ranks import run_pod_ranks

        return run_pod_ranks(topology, local_ranks, environ, leader_rpc_addr(topology, environ))
    cpu_binding.OWN_PROCESS = True  # a rank process: its threads are nobody else's
    parent_pid = int(environ[PARENT_PID_ENV]) if environ.get(PARENT_PID_ENV, "").isdigit() else None
    if parent_pid is not None:
        # Its leader owns its life: a terminal's Ctrl-C (sent to the whole process group) is for
        # the caller, whose engine must still work afterwards, not for the ranks under it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    link = rpc.WorkerLink(leader_rpc_addr(topology, environ), topology.rank, keys, parent_pid=parent_pid)
    logger.info(
        "rank %d of %d: joining %s", topology.rank, topology.world_size, leader_rpc_addr(topology, environ)
    )
    try:
        _serve(link, topology, environ, keys)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        error = traceback.format_exc()
        logger.error("rank %d failed:\n%s", topology.rank, error)
        link.send(rpc.FATAL, {"rank": topology.rank, "error": error[-4000:]})
        link.close()
        return 1
    link.close()
    return 0


def _serve(link: Any, topology: Topology, environ: dict[str, str] | os._Environ[str], keys: Any) -> None:
    from tessera.config import EngineConfig
    from tessera.distributed import rpc
    from tessera.worker.worker import Worker

    try:
        kind, welcome = link.inbox.get(timeout=RANK_STARTUP_TIMEOUT_S)
    except queue.Empty:
        raise TimeoutError(
            f"no leader answered at {leader_rpc_addr(topology, environ)} in {RANK_STARTUP_TIMEOUT_S:.0f} s "
            f"(a leader of another group secret never does: {GROUP_SECRET_FILE_ENV} names this rank's)"
        ) from None
    if kind == rpc.SHUTDOWN:  # the leader gave up before this rank joined (it logs why)
        logger.info("rank %d: the leader shut down before this rank joined", topology.rank)
        return
    if kind != rpc.WELCOME:
        raise RuntimeError(f"expected WELCOME from the leader, got {kind!r}")
    config = EngineConfig.model_validate_json(welcome["config"])
    if config.parallel != topology.layout:
        raise TopologyError(
            f"the leader runs layout {config.parallel}, this rank's environment says {topology.layout}"
        )
    link.limit_replies(config.max_num_seqs, config.max_num_batched_tokens)
    worker = Worker(
        config,
        None,
        topology,
        local_rank=int(environ.get(LOCAL_RANK_ENV, "0")),
        local_world_size=int(environ.get(LOCAL_WORLD_SIZE_ENV, "1")),
        group_keys=keys,
    )
    link.send(rpc.READY, {"rank": topology.rank, "max_model_len": worker.max_model_len})
    link.arm()
    while True:
        kind, payload = link.inbox.get()
        if kind == rpc.EXECUTE:
            output = worker.execute_model(payload["output"], payload["step"])
            if output is not None:
                link.send(rpc.OUTPUT, {"step": payload["step"], "output": output})
        elif kind == rpc.CALL:
            method = payload["method"]
            if method not in CALLABLE:
                raise RuntimeError(f"the leader called {method!r}, which is not a worker method")
            value = getattr(worker, method)(*payload["args"])
            link.send(rpc.RESULT, {"id": payload["id"], "rank": topology.rank, "value": value})
        elif kind == rpc.SHUTDOWN:
            worker.shutdown()
            return
        elif kind == rpc.FATAL:
            raise RuntimeError(payload)


def main() -> None:
    sys.exit(run_worker())


def register_cli(subparsers: Any) -> None:
    """`tessera worker`: a headless rank; everything it needs comes from the environment and its leader."""
    worker = subparsers.add_parser(
        "worker",
        help="run one rank of a multi-rank engine (started by `tessera serve` or as a pod)",
        description="Reads its place from the TESSERA_* environment (see tessera.topology), joins its "
        "leader, and takes the engine configuration from it. Exits non-zero when the leader goes away.",
    )
    worker.set_defaults(handler=lambda args: run_worker())
