"""Starting a rank as its own `tessera worker` process, with exactly the environment a pod would
get: the one launcher of the leader's local ranks (`tessera serve --tp/--pp`, the ranks of a
leader pod) and of a worker pod that runs several ranks (``pod_ranks``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping

from tessera.topology import GROUP_SECRET_FILE_ENV, LOCAL_RANKS_ENV, Topology

# Set by a launcher for the ranks it starts; pods use the topology's TCP address.
RPC_ADDR_ENV = "TESSERA_RPC_ADDR"
LOCAL_RANK_ENV = "LOCAL_RANK"
LOCAL_WORLD_SIZE_ENV = "TESSERA_LOCAL_WORLD_SIZE"
# The pid of the process that started this rank: once it is gone (getppid() differs), so is the rank.
PARENT_PID_ENV = "TESSERA_PARENT_PID"


def rank_env(
    base: Mapping[str, str],
    topology: Topology,
    local_index: int,
    local_world: int,
    rpc_addr: str,
    secret_file: str,
) -> dict[str, str]:
    """``base`` (the launcher's environment) with one rank's topology and its place among the
    launcher's ranks: LOCAL_RANK is its index, hence its device (cuda:<index>)."""
    env = dict(base)
    env.pop(LOCAL_RANKS_ENV, None)  # each process is one rank; only its launcher runs several
    env.update(topology.to_env())
    env[RPC_ADDR_ENV] = rpc_addr
    env[GROUP_SECRET_FILE_ENV] = secret_file
    env[LOCAL_RANK_ENV] = str(local_index)
    env[LOCAL_WORLD_SIZE_ENV] = str(local_world)
    env[PARENT_PID_ENV] = str(os.getpid())
    if topology.leader_addr in ("127.0.0.1", "localhost"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def start_rank(env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """`tessera worker` under ``env`` (see ``rank_env``); it dies with the thread that started it."""
    # The parent-death signal fires when the *thread* that started the rank ends: only the
    # main thread lives as long as the process (an offline LLM may be built on any thread).
    # Elsewhere a rank still exits when its parent process is gone (WorkerLink watches it).
    on_main_thread = threading.current_thread() is threading.main_thread()
    return subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "worker"],
        env=dict(env),
        preexec_fn=_die_with_parent if on_main_thread else None,
    )


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a rank never outlives the process that started it, even on SIGKILL.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
