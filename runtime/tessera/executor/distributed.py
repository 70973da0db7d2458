"""Executors whose ranks are other processes: local ones it starts, or pods that join over TCP.

Both speak to their ranks through one ``LeaderChannel``: a step's SchedulerOutput is broadcast
to every rank, and only the last stage's TP rank 0 answers with sampled tokens, so up to
``pp_size`` steps can be in flight (each a future resolved by the output rank's reply).
Startup: every rank says HELLO, gets the engine configuration, loads its shards and says READY;
then the KV cache is sized to the smallest rank's capacity and initialised on all of them.

Faults: local ranks are watched by their process, every rank by heartbeats. A rank that dies,
stops (SIGSTOP) or reports a failure fails every pending step at once with ExecutorFailedError;
the remaining ranks are told to exit (and local ones are killed), so nothing outlives the engine.

Authentication: the channel admits only holders of the group's secret (``group_secret``). Local
ranks get a random one the leader writes into its private socket folder; a leader of pods reads
the one the operator mounts, and refuses to start without it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

import zmq

from tessera.config import EngineConfig
from tessera.distributed import rpc
from tessera.distributed.group_secret import GroupKeys, read_group_secret, secret_file, write_group_secret
from tessera.executor.base import Executor, ExecutorFailedError
from tessera.ports import free_port
from tessera.topology import GROUP_SECRET_FILE_ENV, Topology
from tessera.wire.sched_output import ModelRunnerOutput, SchedulerOutput
from tessera.worker.rank_launch import rank_env, start_rank
from tessera.worker.worker import STEP_TIMEOUT_S
from tessera.worker.worker_proc import LOCAL_STARTUP_TIMEOUT_S, RANK_STARTUP_TIMEOUT_S, RANKS_IPC_PARENT_ENV

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 600.0


class _Call:
    def __init__(self, world_size: int) -> None:
        self.future: Future[list[Any]] = Future()
        self.results: dict[int, Any] = {}
        self.world_size = world_size


def ranks_ipc_parent() -> str | None:
    """Where the ranks' socket folder goes: inside the engine core's (removed with it), unless
    that makes its socket's path too long for a Unix socket (a long TMPDIR): then the temporary
    folder itself."""
    parent = os.environ.get(RANKS_IPC_PARENT_ENV)
    socket_path = f"{parent}/tessera-ranks-{'x' * 8}/rpc"
    return parent if parent and len(socket_path) <= zmq.IPC_PATH_MAX_LEN else None


class DistributedExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        topology: Topology,
        local_ranks: list[int],
        extra_bind_addrs: list[str],
        startup_timeout_s: float,
        group_secret_file: str | None = None,
    ) -> None:
        """``group_secret_file``: the group's secret, for ranks elsewhere (pods); None makes a
        random one in this leader's socket folder, for ranks it starts itself."""
        # Local ranks reach the leader over IPC in a folder of its own, removed at shutdown.
        self.ipc_dir = tempfile.mkdtemp(prefix="tessera-ranks-", dir=ranks_ipc_parent())
        # Removed at shutdown (or a failed start), at the latest when this object goes or the
        # interpreter exits; calling it again does nothing.
        self._remove_ipc_dir = weakref.finalize(self, shutil.rmtree, self.ipc_dir, ignore_errors=True)
        local_rpc_addr = f"ipc://{self.ipc_dir}/rpc"
        bind_addrs = [local_rpc_addr, *extra_bind_addrs]
        self.config = config
        self.topology = topology
        self.world_size = topology.world_size
        self.max_concurrent_batches = topology.pp_size
        self.output_rank = topology.world_size - topology.tp_size  # last stage, TP rank 0
        self._lock = threading.Condition()
        self.failure: str | None = None
        self._shutting_down = False
        self._steps = itertools.count()
        self._call_ids = itertools.count()
        self._step_futures: dict[int, Future[ModelRunnerOutput]] = {}
        self._calls: dict[int, _Call] = {}
        self._instances: dict[int, str] = {}  # each rank process's random id (pods' pids are all alike)
        self._ready: dict[int, dict[str, Any]] = {}
        self._welcome = {"config": config.model_dump_json()}
        try:
            self.secret_file = group_secret_file or write_group_secret(self.ipc_dir)
            keys = GroupKeys(read_group_secret({GROUP_SECRET_FILE_ENV: self.secret_file}))
            self.channel = rpc.LeaderChannel(
                bind_addrs,
                self.world_size,
                self._on_message,
                self._fail,
                keys,
                output_rank=self.output_rank,
                max_inbound_bytes=rpc.reply_limit(config.max_num_seqs, config.max_num_batched_tokens),
            )
        except BaseException:  # e.g. the RPC port taken: nothing else holds the folder yet
            self._remove_ipc_dir()
            raise
        self.channel.start()  # only now: a pod rank's HELLO may be waiting, and it needs self.channel
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for index, rank in enumerate(local_ranks):
                self.procs[rank] = self._spawn(rank, index, len(local_ranks), local_rpc_addr)
            self._wait_ready(startup_timeout_s)
            self.max_model_len = min(int(info["max_model_len"]) for info in self._ready.values())
            self.initialize_kv_cache(config)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "%d ranks ready (tp %d x pp %d%s), %d KV blocks each",
            self.world_size, topology.tp_size, topology.pp_size,
            ", sequence parallel" if topology.sequence_parallel else "", self.num_kv_blocks,
        )  # fmt: skip

    # --- ranks -----------------------------------------------------------------------------------
    def _spawn(self, rank: int, local_index: int, local_world: int, rpc_addr: str) -> subprocess.Popen[bytes]:
        """Start one rank as `tessera worker`, with exactly the environment a pod would get."""
        topology = self.topology.for_rank(rank)
        proc = start_rank(
            rank_env(os.environ, topology, local_index, local_world, rpc_addr, self.secret_file)
        )
        threading.Thread(
            target=self._watch, args=(rank, proc), name=f"watch-rank-{rank}", daemon=True
        ).start()
        return proc

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._shutting_down:
            self._fail(f"rank {rank} exited with status {code}")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self._ready) < self.world_size and self.failure is None:
                if time.monotonic() > deadline:
                    absent = sorted(set(range(self.world_size)) - set(self._instances))
                    if absent:
                        raise ExecutorFailedError(f"ranks {absent} never joined in {timeout_s:.0f} s")
                    missing = sorted(set(range(self.world_size)) - set(self._ready))
                    raise ExecutorFailedError(f"ranks {missing} not ready after {timeout_s:.0f} s")
                self._lock.wait(0.5)
            self._raise_if_failed()

    # --- messages from ranks (the channel's I/O thread) ---------------------------------------------
    def _on_message(self, rank: int, kind: bytes, payload: Any) -> None:
        if kind == rpc.HELLO:
            self._on_hello(rank, str(payload.get("instance", "")))
        elif kind == rpc.READY:
            self.channel.watch(rank)
            with self._lock:
                self._ready[rank] = payload
                self._lock.notify_all()
        elif kind == rpc.OUTPUT:
            with self._lock:
                future = self._step_futures.pop(int(payload["step"]), None)
            if future is not None:
                future.set_result(payload["output"])
        elif kind == rpc.RESULT:
            self._on_result(rank, payload)
        elif kind == rpc.FATAL:
            self._fail(f"rank {rank} failed:\n{payload.get('error', '')}")

    def _on_hello(self, rank: int, instance: str) -> None:
        """A rank joined (a replacement of a rank under another instance fails in the channel)."""
        if rank in self._instances:
            return
        self._instances[rank] = instance
        # A rank that dies while it loads fails the group now, not at the startup timeout.
        self.channel.watch(rank, rpc.STARTUP_SILENCE_S)
        if len(self._instances) == self.world_size:
            # Every rank is here: only now does the rendezvous start, so no rank waits in it
            # (bounded by the collective timeout) for a pod still pulling its image.
            self.channel.send(list(range(self.world_size)), rpc.WELCOME, self._welcome)

    def _on_result(self, rank: int, payload: dict[str, Any]) -> None:
        with self._lock:
            call = self._calls.get(int(payload["id"]))
            if call is None:
                return
            call.results[rank] = payload.get("value")
            if len(call.results) < call.world_size:
                return
            del self._calls[int(payload["id"])]
        call.future.set_result([call.results[r] for r in range(call.world_size)])

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None or self._shutting_down:
                return
            self.failure = reason
            futures: list[Future[Any]] = [
                *self._step_futures.values(),
                *(c.future for c in self._calls.values()),
            ]
            self._step_futures.clear()
            self._calls.clear()
            self._lock.notify_all()
        logger.error("engine failed: %s", reason)
        error = ExecutorFailedError(reason)
        for future in futures:
            with contextlib.suppress(Exception):
                future.set_exception(error)
        # No rank outlives a failed engine: remote ranks exit on ABORT, local ones are killed.
        with contextlib.suppress(Exception):
            self.channel.broadcast(rpc.ABORT, reason[:1000])
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise ExecutorFailedError(self.failure)

    # --- the Executor interface --------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        call = _Call(self.world_size)
        with self._lock:
            self._raise_if_failed()
            call_id = next(self._call_ids)
            self._calls[call_id] = call
        self.channel.broadcast(rpc.CALL, {"id": call_id, "method": method, "args": list(args)})
        return self._result(call.future, RPC_TIMEOUT_S, f"collective_rpc({method})")

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        future: Future[ModelRunnerOutput] = Future()
        with self._lock:
            self._raise_if_failed()
            step = next(self._steps)
            self._step_futures[step] = future
        self.channel.broadcast(rpc.EXECUTE, {"step": step, "output": scheduler_output})
        return future if non_block else self._result(future, STEP_TIMEOUT_S, f"step {step}")

    def wait(self, future: Future[ModelRunnerOutput]) -> ModelRunnerOutput:
        return self._result(future, STEP_TIMEOUT_S, "a step")

    def _result(self, future: Future[Any], timeout_s: float, what: str) -> Any:
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            self._fail(f"{what} got no answer in {timeout_s:.0f} s")
            raise ExecutorFailedError(self.failure or what) from None

    def check_health(self) -> None:
        self._raise_if_failed()

    def shutdown(self) -> None:
        if self._shutting_down:
            return
        with contextlib.suppress(Exception):
            self.channel.broadcast(rpc.SHUTDOWN, None)
        self._shutting_down = True
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.channel.close()
        self._remove_ipc_dir()


class MultiprocExecutor(DistributedExecutor):
    """Every rank a local process: `tessera serve MODEL --tp T --pp P` on one machine (IPC)."""

    def __init__(self, config: EngineConfig) -> None:
        topology = Topology(layout=config.parallel, leader_addr="127.0.0.1", dist_port=free_port())
        super().__init__(config, topology, list(range(topology.world_size)), [], LOCAL_STARTUP_TIMEOUT_S)


class RemoteRanksExecutor(DistributedExecutor):
    """The leader pod: rank 0 runs here (with the next ranks of stage 0 when the pod holds the
    stage's whole TP group, TESSERA_LOCAL_RANKS), every other rank is in a pod that joins over TCP."""

    def __init__(self, config: EngineConfig, topology: Topology) -> None:
        if not topology.is_leader:
            raise ValueError(
                f"`tessera serve` runs on rank 0 only; this is rank {topology.rank} (use `tessera worker`)"
            )
        if topology.layout != config.parallel:
            raise ValueError(f"engine layout {config.parallel} differs from the topology's {topology.layout}")
        read_group_secret(os.environ)  # none readable: refuse to start, naming the file and variable
        super().__init__(
            config,
            topology,
            topology.local_ranks(os.environ),
            [f"tcp://*:{topology.rpc_port}"],
            RANK_STARTUP_TIMEOUT_S,
            group_secret_file=secret_file(os.environ),
        )
