"""The engine core in its own process: a busy loop around EngineCore, ZeroMQ I/O in threads beside it.

Wire protocol (multipart frames, payloads msgpack-encoded by `serialization`):
  frontend -> core (PUSH/PULL): [ADD, EngineCoreRequest] | [ABORT, list[str]] | [SHUTDOWN, None]
  core -> frontend (PUSH/PULL): [READY, dict] once the model is loaded (the handshake),
                                [OUTPUTS, EngineCoreOutputs] after every step,
                                [DEAD, str] with the traceback when the loop fails.
The socket threads release the GIL while blocked in zmq, so I/O overlaps model execution.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from tessera.config import EngineConfig
from tessera.engine import serialization
from tessera.engine.messages import EngineCoreOutputs

logger = logging.getLogger(__name__)

ADD = b"ADD"
ABORT = b"ABORT"
SHUTDOWN = b"SHUTDOWN"
READY = b"READY"
OUTPUTS = b"OUTPUTS"
DEAD = b"DEAD"

_STOP = object()  # tells the output thread to flush and exit


class EngineCoreProc:
    """Runs `engine` (an EngineCore) until shutdown, fed and drained through two ZMQ sockets."""

    def __init__(self, engine: Any, input_addr: str, output_addr: str) -> None:
        self.engine = engine
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._zmq = zmq.Context()
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(input_addr,), name="core-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._output_loop, args=(output_addr,), name="core-output", daemon=True
        )
        self._input_thread.start()
        self._output_thread.start()

    # --- socket threads -------------------------------------------------------------
    def _input_loop(self, addr: str) -> None:
        sock = self._zmq.socket(zmq.PULL)
        sock.connect(addr)
        while True:
            try:
                kind, payload = sock.recv_multipart()
            except zmq.ZMQError:
                return
            self.input_queue.put((kind, serialization.decode(payload)))

    def _output_loop(self, addr: str) -> None:
        sock = self._zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(addr)
        while True:
            item = self.output_queue.get()
            if item is _STOP:
                sock.close()
                return
            kind, payload = item
            sock.send_multipart([kind, serialization.encode(payload)], copy=False)

    # --- the busy loop --------------------------------------------------------------
    def run(self, ready_info: dict[str, Any]) -> None:
        self.output_queue.put((READY, ready_info))
        while True:
            # Idle: block until the frontend sends something.
            if not self.engine.has_unfinished_requests() and not self._handle(*self._next_input()):
                return
            while not self.input_queue.empty():
                if not self._handle(*self.input_queue.get_nowait()):
                    return
            if self.engine.has_unfinished_requests():
                self._step()

    def _next_input(self) -> tuple[bytes, Any]:
        """Block for the next message; meanwhile check the ranks, so an idle engine fails promptly too."""
        while True:
            try:
                return self.input_queue.get(timeout=1.0)
            except queue.Empty:
                check_health = getattr(self.engine, "check_health", None)
                if check_health is not None:
                    check_health()

    def _step(self) -> None:
        started = time.time()
        outputs: EngineCoreOutputs = self.engine.step()
        # The start of the step that produced these tokens: the frontend derives queue time from it.
        outputs.timestamp = started
        self.output_queue.put((OUTPUTS, outputs))
        if not self.engine.has_unfinished_requests():
            self._publish_idle_stats()

    def _handle(self, kind: bytes, payload: Any) -> bool:
        if kind == ADD:
            self.engine.add_request(payload)
        elif kind == ABORT:
            self.engine.abort_requests(payload)
            if not self.engine.has_unfinished_requests():
                self._publish_idle_stats()
        elif kind == SHUTDOWN:
            return False
        else:
            logger.error("engine core: unknown message %r", kind)
        return True

    def _publish_idle_stats(self) -> None:
        """With nothing left to run, report fresh stats (blocks freed by the last finish or abort)."""
        make_stats = getattr(self.engine, "make_stats", None)
        if make_stats is not None:
            outputs = EngineCoreOutputs(scheduler_stats=make_stats(), timestamp=time.time())
        else:
            outputs = self.engine.step()  # EngineCore.step() with nothing to run only reports stats
        self.output_queue.put((OUTPUTS, outputs))

    def close(self, error: str | None = None) -> None:
        if error is not None:
            self.output_queue.put((DEAD, error))
        self.output_queue.put(_STOP)
        self._output_thread.join(timeout=5)
        # The context is left to process exit: the input thread still blocks in recv on it.


def _exit_when_parent_dies() -> None:
    """A frontend killed with SIGKILL cannot stop us: watch its sentinel and leave with it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_engine_core(
    config_json: str, input_addr: str, output_addr: str, engine_core_cls: type | None
) -> None:
    """Entry point of the spawned engine core process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine-core] %(message)s")
    _exit_when_parent_dies()
    shutdown_requested = threading.Event()

    def on_sigterm(signum: int, frame: object) -> None:
        shutdown_requested.set()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the frontend, which shuts us down
    config = EngineConfig.model_validate_json(config_json)
    proc: EngineCoreProc | None = None
    try:
        if engine_core_cls is None:
            from tessera.engine.core import EngineCore

            engine_core_cls = EngineCore
        engine = engine_core_cls(config)
        proc = EngineCoreProc(engine, input_addr, output_addr)
        proc.run(_ready_info(engine))
        engine.shutdown()
        proc.close()
    except SystemExit:
        if proc is not None:
            proc.close()
        raise
    except BaseException:
        error = traceback.format_exc()
        logger.error("engine core failed:\n%s", error)
        if proc is None:
            # Failed while loading: the frontend is still waiting for READY; tell it why.
            proc = EngineCoreProc(_NoEngine(), input_addr, output_addr)
        proc.close(error)
        sys.exit(1)


def _ready_info(engine: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"pid": os.getpid()}
    for name in ("max_model_len", "num_kv_blocks", "block_size"):
        value = getattr(engine, name, None)
        if isinstance(value, int):
            info[name] = value
    return info


class _NoEngine:
    def has_unfinished_requests(self) -> bool:
        return False
