"""EngineCoreClient: the frontend's only way to reach the engine core process.

Spawns the process, waits for its READY handshake, then sends requests and aborts and
receives EngineCoreOutputs over ZeroMQ. A monitor thread waits on the process sentinel:
the moment the process dies, every caller waiting for outputs gets EngineDeadError.
Two flavours: SyncMPClient (blocking get_output) and AsyncMPClient (awaitable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import queue
import shutil
import tempfile
import threading
import time
from typing import Any

import zmq

from tessera.config import EngineConfig
from tessera.engine import serialization
from tessera.engine.core_proc import ABORT, ADD, DEAD, OUTPUTS, READY, SHUTDOWN, run_engine_core
from tessera.engine.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0  # model loading (and GGUF conversion on a first run) can be slow


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can complete."""


class MPClientBase:
    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        self.dead_error: EngineDeadError | None = None
        self._shutting_down = False
        self._send_lock = threading.Lock()
        self._ipc_dir = tempfile.mkdtemp(prefix="tessera-core-")
        input_addr = f"ipc://{self._ipc_dir}/input"
        output_addr = f"ipc://{self._ipc_dir}/output"
        self._zmq = zmq.Context()
        self._input = self._zmq.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_addr)
        self._output = self._zmq.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_addr)
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold torch threads
        # Not a daemon: the engine core may start worker processes of its own.
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(config.model_dump_json(), input_addr, output_addr, engine_core_cls),
            name="tessera-engine-core",
        )
        self.proc.start()
        logger.info("engine core process started (pid %s)", self.proc.pid)
        try:
            self.ready_info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._monitor_loop, name="core-monitor", daemon=True)
        self._monitor.start()
        self._receiver: threading.Thread | None = None

    # --- startup ----------------------------------------------------------------------
    def _wait_ready(self) -> dict[str, Any]:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._output.poll(100):
                kind, payload = self._output.recv_multipart()
                if kind == READY:
                    return dict(serialization.decode(payload))
                if kind == DEAD:
                    raise EngineDeadError(f"engine core failed to start:\n{serialization.decode(payload)}")
            elif not self.proc.is_alive():
                raise EngineDeadError(f"engine core exited during startup (exit code {self.proc.exitcode})")
        raise EngineDeadError(f"engine core not ready after {STARTUP_TIMEOUT_S:.0f} s")

    # --- background threads -------------------------------------------------------------
    def _start_receiver(self) -> None:
        self._receiver = threading.Thread(target=self._receive_loop, name="core-receiver", daemon=True)
        self._receiver.start()

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        while not self._shutting_down:
            if not poller.poll(200):
                continue
            try:
                kind, payload = self._output.recv_multipart()
            except zmq.ZMQError:
                return
            if kind == OUTPUTS:
                self._deliver(serialization.decode(payload))
            elif kind == DEAD:
                self._mark_dead(f"engine core failed:\n{serialization.decode(payload)}")

    def _monitor_loop(self) -> None:
        ready = multiprocessing.connection.wait([self.proc.sentinel, self._stop_r])
        if self.proc.sentinel in ready and not self._shutting_down:
            self.proc.join(timeout=1)
            self._mark_dead(f"engine core process died (exit code {self.proc.exitcode})")

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
        if self.dead_error is not None:
            raise self.dead_error
        data = serialization.encode(payload)
        with self._send_lock:
            self._input.send_multipart([kind, data], copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(ABORT, list(request_ids))

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self.proc.is_alive()

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


class SyncMPClient(MPClientBase):
    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        super().__init__(config, engine_core_cls)
        self._queue: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        if self.dead_error is not None:
            self._queue.put(self.dead_error)
        self._start_receiver()

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        queue_ = getattr(self, "_queue", None)
        if queue_ is not None:
            queue_.put(item)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next step's outputs; raises EngineDeadError once the core is gone, queue.Empty on timeout."""
        item = self._queue.get(timeout=timeout)
        if isinstance(item, EngineDeadError):
            self._queue.put(item)  # every later caller fails too
            raise item
        return item


class AsyncMPClient(MPClientBase):
    """The asyncio flavour: outputs are awaited on the loop that first asks for them."""

    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        super().__init__(config, engine_core_cls)

    def _ensure_started(self) -> asyncio.Queue[EngineCoreOutputs | EngineDeadError]:
        if self._queue is None:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            self._start_receiver()
        return self._queue

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        loop, queue_ = self._loop, self._queue
        if loop is None or queue_ is None:
            return  # nobody listens yet; dead_error is checked on the first get
        with contextlib.suppress(RuntimeError):  # a closed loop: the process is shutting down
            loop.call_soon_threadsafe(queue_.put_nowait, item)

    async def get_output_async(self) -> EngineCoreOutputs:
        queue_ = self._ensure_started()
        if queue_.empty() and self.dead_error is not None:
            raise self.dead_error
        item = await queue_.get()
        if isinstance(item, EngineDeadError):
            queue_.put_nowait(item)
            raise item
        return item

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)
