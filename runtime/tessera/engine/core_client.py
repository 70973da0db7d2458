"""EngineCoreClient: the frontend's only way to reach the engine core process.

Spawns the process, waits for its READY handshake, then sends requests and aborts and
receives EngineCoreOutputs over ZeroMQ. A monitor thread waits on the process sentinel:
the moment the process dies, every caller waiting for outputs gets EngineDeadError.
The core's heartbeats tell a live core from a deaf (input thread gone, or silent) or stuck
one (a step that does not end): ``health_problem()`` names what is wrong, for /health.
Two flavours: SyncMPClient (blocking get_output) and AsyncMPClient (awaitable).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import queue
import shutil
import tempfile
import threading
import time
from typing import Any

import zmq

from tessera.config import EngineConfig
from tessera.engine.core_proc import (
    ABORT,
    ADD,
    DEAD,
    HEARTBEAT,
    OUTPUTS,
    READY,
    SHUTDOWN,
    log_protocol_error,
    run_engine_core,
    set_max_message_size,
)
from tessera.wire import serialization
from tessera.wire.messages import EngineCoreHeartbeat, EngineCoreOutputs, EngineCoreRequest
from tessera.worker.worker_proc import LOCAL_STARTUP_TIMEOUT_S, RANK_STARTUP_TIMEOUT_S

logger = logging.getLogger(__name__)

# Model loading (and GGUF conversion on a first run) can be slow. Beyond the engine core's own
# limit for its ranks to join and load, so that a core that gives up on a rank says which first.
STARTUP_TIMEOUT_S = max(RANK_STARTUP_TIMEOUT_S, LOCAL_STARTUP_TIMEOUT_S) + 900.0
# The core heartbeats every second; this much silence means it stopped answering.
HEARTBEAT_TIMEOUT_S = float(os.environ.get("TESSERA_ENGINE_HEARTBEAT_TIMEOUT_S", "30"))
# One busy-loop iteration (a step) running this long with work queued means the core is stuck.
STALL_TIMEOUT_S = float(os.environ.get("TESSERA_ENGINE_STALL_TIMEOUT_S", "60"))
# A core silent this long (frozen, not dead) is killed, so its callers fail instead of hanging.
FATAL_SILENCE_S = float(os.environ.get("TESSERA_ENGINE_FATAL_SILENCE_S", str(3 * HEARTBEAT_TIMEOUT_S)))
# Messages the core has not taken for this long (its input queue full) make it unhealthy.
BACKLOG_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can complete."""


class MPClientBase:
    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        self.dead_error: EngineDeadError | None = None
        self.heartbeat_timeout_s = HEARTBEAT_TIMEOUT_S
        self.stall_timeout_s = STALL_TIMEOUT_S
        self._heartbeat = EngineCoreHeartbeat(input_alive=True, stalled_s=0.0, protocol_errors=0)
        self._heartbeat_at = time.monotonic()
        self._own_protocol_errors = 0  # malformed messages from the core, dropped here
        self._shutting_down = False
        self._send_lock = threading.Lock()
        self.fatal_silence_s = FATAL_SILENCE_S
        self.backlog_timeout_s = BACKLOG_TIMEOUT_S
        # Sends never block the caller (the server's event loop): what the core's full input
        # queue does not take waits here, in order, and the receiver thread retries it.
        self._backlog: collections.deque[tuple[bytes, bytes, float]] = collections.deque()
        self._ipc_dir = tempfile.mkdtemp(prefix="tessera-core-")
        input_addr = f"ipc://{self._ipc_dir}/input"
        output_addr = f"ipc://{self._ipc_dir}/output"
        self._zmq = zmq.Context()
        self._input = self._zmq.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_addr)
        self._output = self._zmq.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        set_max_message_size(self._output)
        self._output.bind(output_addr)
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold torch threads
        # Not a daemon: the engine core may start worker processes of its own.
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(config.model_dump_json(), input_addr, output_addr, engine_core_cls),
            name="tessera-engine-core",
        )
        # Stopped before multiprocessing's exit hook joins it: a script that never calls
        # shutdown() (or failed before it) would wait at exit for the idle core forever.
        self._stop_at_exit = multiprocessing.util.Finalize(self, self.shutdown, exitpriority=10)
        try:
            self.proc.start()
            logger.info("engine core process started (pid %s)", self.proc.pid)
            self.ready_info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._heartbeat_at = time.monotonic()
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._monitor_loop, name="core-monitor", daemon=True)
        self._monitor.start()
        # Started now, not on the first request: heartbeats must be read while the server idles.
        self._receiver = threading.Thread(target=self._receive_loop, name="core-receiver", daemon=True)
        self._receiver.start()

    # --- startup ----------------------------------------------------------------------
    def _wait_ready(self) -> dict[str, Any]:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._output.poll(100):
                message = self._receive()
                if message is None:
                    continue
                kind, payload = message
                if kind == READY and isinstance(payload, dict):
                    return payload
                if kind == DEAD:
                    raise EngineDeadError(f"engine core failed to start:\n{payload}")
            elif not self.proc.is_alive():
                raise EngineDeadError(f"engine core exited during startup (exit code {self.proc.exitcode})")
        raise EngineDeadError(f"engine core not ready after {STARTUP_TIMEOUT_S:.0f} s")

    # --- background threads -------------------------------------------------------------
    def _receive(self) -> tuple[bytes, Any] | None:
        """One message from the core, or None (counted) when it is malformed."""
        frames = self._output.recv_multipart()
        try:
            if len(frames) != 2:
                raise serialization.DecodeError(f"expected 2 frames, got {len(frames)}")
            return frames[0], serialization.decode(frames[1])
        except serialization.DecodeError as error:
            self._own_protocol_errors += 1
            log_protocol_error(self._own_protocol_errors, "the engine core", error)
            return None

    def _receive_loop(self) -> None:
        try:
            self._receive_until_shutdown()
        except Exception as error:  # without this thread no output arrives: fail loudly
            logger.exception("engine core receiver failed")
            self._mark_dead(f"engine core receiver failed: {error!r}")

    def _receive_until_shutdown(self) -> None:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        while not self._shutting_down:
            if self._backlog:
                self._flush_backlog()
            if not poller.poll(20 if self._backlog else 200):
                continue
            try:
                message = self._receive()
            except zmq.ZMQError:
                return
            if message is None:
                continue
            kind, payload = message
            if kind == OUTPUTS and isinstance(payload, EngineCoreOutputs):
                self._deliver(payload)
            elif kind == HEARTBEAT and isinstance(payload, EngineCoreHeartbeat):
                self._heartbeat, self._heartbeat_at = payload, time.monotonic()
            elif kind == DEAD:
                self._mark_dead(f"engine core failed:\n{payload}")
            else:
                self._own_protocol_errors += 1
                log_protocol_error(self._own_protocol_errors, "the engine core", f"unexpected {kind[:32]!r}")

    def _monitor_loop(self) -> None:
        while True:
            ready = multiprocessing.connection.wait([self.proc.sentinel, self._stop_r], timeout=1.0)
            if self._stop_r in ready or self._shutting_down:
                return
            if self.proc.sentinel in ready:
                self.proc.join(timeout=1)
                self._mark_dead(f"engine core process died (exit code {self.proc.exitcode})")
                return
            silent_s = time.monotonic() - self._heartbeat_at
            if silent_s > self.fatal_silence_s:
                self._mark_dead(f"engine core did not answer for {silent_s:.0f} s; killed it")
                self.proc.kill()
                return

    def _mark_dead(self, message: str) -> None:
        if self.dead_error is not None or self._shutting_down:
            return
        logger.error("%s", message)
        self.dead_error = EngineDeadError(message)
        self._deliver(self.dead_error)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        raise NotImplementedError

    # --- requests -------------------------------------------------------------------------
    def _send(self, kind: bytes, payload: Any) -> None:
        if self._shutting_down:
            if kind == ADD:  # it would wait forever for outputs
                raise EngineDeadError("the engine core is shutting down")
            return  # an abort: the core is going away with everything it holds
        if self.dead_error is not None:
            raise self.dead_error
        data = serialization.encode(payload)
        with self._send_lock:
            if not self._backlog:
                try:
                    self._input.send_multipart([kind, data], zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    pass
            self._backlog.append((kind, data, time.monotonic()))

    def _flush_backlog(self) -> None:
        with self._send_lock:
            while self._backlog and not self._shutting_down:
                kind, data, _ = self._backlog[0]
                try:
                    self._input.send_multipart([kind, data], zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._backlog.popleft()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(ABORT, list(request_ids))

    @property
    def protocol_errors(self) -> int:
        """Malformed messages dropped so far, by the core (its last heartbeat) and by this client."""
        return self._heartbeat.protocol_errors + self._own_protocol_errors

    def health_problem(self) -> str | None:
        """Why the engine core cannot serve (dead, deaf or stuck), or None when it is healthy."""
        if self.dead_error is not None:
            return "the engine core has failed"
        if not self.proc.is_alive():
            return "the engine core process is not running"
        silent_s = time.monotonic() - self._heartbeat_at
        if silent_s > self.heartbeat_timeout_s:
            return f"the engine core has not answered for {silent_s:.0f} s"
        if not self._heartbeat.input_alive:
            return "the engine core no longer receives requests"
        try:  # the receiver thread may empty the backlog meanwhile
            waited_s = time.monotonic() - self._backlog[0][2]
        except IndexError:
            waited_s = 0.0
        if waited_s > self.backlog_timeout_s:
            return f"the engine core has taken no request for {waited_s:.0f} s"
        stalled_s = self._heartbeat.stalled_s + silent_s
        if self._heartbeat.stalled_s > 0 and stalled_s > self.stall_timeout_s:
            return f"the engine core has made no progress for {stalled_s:.0f} s"
        return None

    @property
    def is_alive(self) -> bool:
        return self.health_problem() is None

    def shutdown(self) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        if self.proc.is_alive():
            try:
                with self._send_lock:
                    self._input.send_multipart([SHUTDOWN, serialization.encode(None)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        stop_w = getattr(self, "_stop_w", None)
        if stop_w is not None:
            stop_w.send(None)
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            receiver.join(timeout=2)
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self._stop_at_exit.cancel()


class SyncMPClient(MPClientBase):
    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        self._queue: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        super().__init__(config, engine_core_cls)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self._queue.put(item)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next step's outputs; raises EngineDeadError once the core is gone, queue.Empty on timeout."""
        item = self._queue.get(timeout=timeout)
        if isinstance(item, EngineDeadError):
            self._queue.put(item)  # every later caller fails too
            raise item
        return item


class AsyncMPClient(MPClientBase):
    """The asyncio flavour: outputs are awaited on the loop that first asks for them.

    The receiver thread runs from the start, so outputs wait in a thread-safe deque and the
    loop is woken through an Event set with call_soon_threadsafe.
    """

    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        self._items: collections.deque[EngineCoreOutputs | EngineDeadError] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config, engine_core_cls)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self._items.append(item)
        loop, wakeup = self._loop, self._wakeup
        if loop is not None and wakeup is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: the process is shutting down
                loop.call_soon_threadsafe(wakeup.set)

    async def get_output_async(self) -> EngineCoreOutputs:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
            self._loop = asyncio.get_running_loop()
        while not self._items:
            self._wakeup.clear()
            if self._items:
                break
            await self._wakeup.wait()
        item = self._items[0]
        if isinstance(item, EngineDeadError):
            raise item  # left in place: every later caller fails too
        self._items.popleft()
        return item

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)
