"""The engine core in its own process: a busy loop around EngineCore, ZeroMQ I/O in threads beside it.

Wire protocol (multipart frames, payloads msgpack-encoded by `serialization`):
  frontend -> core (PUSH/PULL): [ADD, EngineCoreRequest] | [ABORT, list[str]] | [SHUTDOWN, None]
  core -> frontend (PUSH/PULL): [READY, dict] once the model is loaded (the handshake),
                                [OUTPUTS, EngineCoreOutputs] after every step,
                                [HEARTBEAT, EngineCoreHeartbeat] about once a second,
                                [DEAD, str] with the traceback when the loop fails.
The socket threads release the GIL while blocked in zmq, so I/O overlaps model execution.

No message can kill the core: a malformed one is logged, counted (the heartbeat reports the
count) and dropped, and a request the engine cannot take fails alone with FINISH_ERROR. A
socket thread that dies anyway is a fault of the engine: the busy loop notices and dies loudly.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from tessera.config import EngineConfig
from tessera.core.request import RequestRejected
from tessera.wire import serialization
from tessera.wire.messages import (
    FINISH_ERROR,
    EngineCoreHeartbeat,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from tessera.worker import cpu_binding
from tessera.worker.worker_proc import RANKS_IPC_PARENT_ENV

logger = logging.getLogger(__name__)

ADD = b"ADD"
ABORT = b"ABORT"
SHUTDOWN = b"SHUTDOWN"
READY = b"READY"
OUTPUTS = b"OUTPUTS"
HEARTBEAT = b"HEARTBEAT"
DEAD = b"DEAD"

HEARTBEAT_INTERVAL_S = 1.0
# How often an idle busy loop wakes to check that its socket threads still run.
THREAD_CHECK_INTERVAL_S = 1.0

_STOP = object()  # tells the output thread to flush and exit
_INPUT_DIED = b"_INPUT_DIED"  # put on the input queue by a dying input thread


def set_max_message_size(sock: zmq.Socket, max_bytes: int = serialization.DEFAULT_MAX_BYTES) -> None:  # type: ignore[type-arg]
    """Make zmq drop (and disconnect) a peer sending a frame larger than ``max_bytes``."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


def log_protocol_error(count: int, sender: str, error: object) -> None:
    """Log the first few malformed messages, then every thousandth: a flood must not flood the log."""
    if count <= 10 or count % 1000 == 0:
        logger.warning("dropped a malformed message from %s (%d so far): %.200s", sender, count, error)


def parse_input(frames: list[bytes]) -> tuple[bytes, Any]:
    """One frontend message, checked for shape and payload type; DecodeError otherwise."""
    if len(frames) != 2:
        raise serialization.DecodeError(f"expected 2 frames, got {len(frames)}")
    kind, data = frames
    payload = serialization.decode(data)
    if kind == ADD and not isinstance(payload, EngineCoreRequest):
        raise serialization.DecodeError("ADD carries no EngineCoreRequest")
    if kind == ABORT and not (isinstance(payload, list) and all(type(i) is str for i in payload)):
        raise serialization.DecodeError("ABORT carries no list of request ids")
    if kind not in (ADD, ABORT, SHUTDOWN):
        raise serialization.DecodeError(f"unknown message kind {kind[:32]!r}")
    return kind, payload


class EngineCoreProc:
    """Runs `engine` (an EngineCore) until shutdown, fed and drained through two ZMQ sockets."""

    def __init__(self, engine: Any, input_addr: str, output_addr: str) -> None:
        self.engine = engine
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.protocol_errors = 0
        # monotonic() when the busy loop started its current iteration; None while it idles.
        self._busy_since: float | None = None
        self._output_failure: str | None = None
        self._zmq = zmq.Context()
        self._input_thread = threading.Thread(
            target=self._guarded(self._input_loop, self._on_input_death),
            args=(input_addr,),
            name="core-input",
            daemon=True,
        )
        self._output_thread = threading.Thread(
            target=self._guarded(self._output_loop, self._on_output_death),
            args=(output_addr,),
            name="core-output",
            daemon=True,
        )
        self._input_thread.start()
        self._output_thread.start()

    # --- socket threads -------------------------------------------------------------
    @staticmethod
    def _guarded(loop: Callable[[str], None], on_death: Callable[[str], None]) -> Callable[[str], None]:
        def run(addr: str) -> None:
            try:
                loop(addr)
            except BaseException:
                on_death(traceback.format_exc())

        return run

    def _on_input_death(self, error: str) -> None:
        logger.error("engine core input thread died:\n%s", error)
        self.input_queue.put((_INPUT_DIED, error))

    def _on_output_death(self, error: str) -> None:
        logger.error("engine core output thread died:\n%s", error)
        self._output_failure = error

    def _input_loop(self, addr: str) -> None:
        sock = self._zmq.socket(zmq.PULL)
        set_max_message_size(sock)
        sock.connect(addr)
        while True:
            try:
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return
            try:
                self.input_queue.put(parse_input(frames))
            except serialization.DecodeError as error:
                self.protocol_errors += 1
                log_protocol_error(self.protocol_errors, "the frontend", error)

    def _output_loop(self, addr: str) -> None:
        sock = self._zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(addr)
        next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL_S
        while True:
            try:
                item = self.output_queue.get(timeout=max(0.0, next_heartbeat - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                sock.close()
                return
            if item is not None:
                kind, payload = item
                sock.send_multipart([kind, serialization.encode(payload)], copy=False)
            if time.monotonic() >= next_heartbeat:
                sock.send_multipart([HEARTBEAT, serialization.encode(self.heartbeat())], copy=False)
                next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL_S

    def heartbeat(self) -> EngineCoreHeartbeat:
        busy_since = self._busy_since
        return EngineCoreHeartbeat(
            input_alive=self._input_thread.is_alive(),
            stalled_s=0.0 if busy_since is None else time.monotonic() - busy_since,
            protocol_errors=self.protocol_errors,
        )

    # --- the busy loop --------------------------------------------------------------
    def run(self, ready_info: dict[str, Any]) -> None:
        self.output_queue.put((READY, ready_info))
        while True:
            # Idle: block until the frontend sends something.
            if not self.engine.has_unfinished_requests() and not self._handle(*self._next_input()):
                return
            self._busy_since = time.monotonic()
            self._check_output_thread()
            if not self._handle_queued():
                return
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle_queued(self) -> bool:
        """Every message that arrived during the step, in order; consecutive aborts as one (a
        disconnect storm's thousands cost the scheduler one pass over its queues, not one each)."""
        aborts: list[str] = []
        while not self.input_queue.empty():
            kind, payload = self.input_queue.get_nowait()
            if kind == ABORT:
                aborts.extend(payload)
                continue
            if aborts:
                self._handle(ABORT, aborts)
                aborts = []
            if not self._handle(kind, payload):
                return False
        if aborts:
            self._handle(ABORT, aborts)
        return True

    def _next_input(self) -> tuple[bytes, Any]:
        """Block for the next message; meanwhile check the ranks, so an idle engine fails promptly too."""
        self._busy_since = None
        while True:
            self._check_output_thread()
            try:
                return self.input_queue.get(timeout=THREAD_CHECK_INTERVAL_S)
            except queue.Empty:
                check_health = getattr(self.engine, "check_health", None)
                if check_health is not None:
                    check_health()

    def _check_output_thread(self) -> None:
        if self._output_failure is not None or not self._output_thread.is_alive():
            raise RuntimeError(f"the engine core output thread died:\n{self._output_failure}")

    def _step(self) -> None:
        outputs: EngineCoreOutputs = self.engine.step()
        # When the tokens were made: inter-token latency by the engine's clock, not by when the
        # frontend got around to them (several steps' outputs may arrive at once).
        outputs.timestamp = time.time()
        self.output_queue.put((OUTPUTS, outputs))
        if not self.engine.has_unfinished_requests():
            self._publish_idle_stats()

    def _handle(self, kind: bytes, payload: Any) -> bool:
        if kind == ADD:
            self._add_request(payload)
        elif kind == ABORT:
            self.engine.abort_requests(payload)
            if not self.engine.has_unfinished_requests():
                self._publish_idle_stats()
        elif kind == SHUTDOWN:
            return False
        elif kind == _INPUT_DIED:
            raise RuntimeError(f"the engine core input thread died:\n{payload}")
        return True

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.engine.add_request(request)
        except RequestRejected as error:
            logger.warning("request %.100r rejected: %s", request.request_id, error)
            failed = EngineCoreOutput(
                request_id=str(request.request_id),
                new_token_ids=[],
                finish_reason=FINISH_ERROR,
                error=str(error),
            )
            self.output_queue.put((OUTPUTS, EngineCoreOutputs(outputs=[failed], timestamp=time.time())))

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


def _exit_when_parent_dies(folders: list[str]) -> None:
    """A frontend killed with SIGKILL cannot stop us: watch its sentinel and leave with it,
    removing the IPC folders (its, and our ranks') nobody else will (the ranks die with us)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_engine_core(
    config_json: str, input_addr: str, output_addr: str, engine_core_cls: type | None
) -> None:
    """Entry point of the spawned engine core process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine-core] %(message)s")
    orphaned = [os.path.dirname(input_addr.removeprefix("ipc://"))] if input_addr.startswith("ipc://") else []
    if orphaned:
        # Its ranks' IPC sockets go inside the frontend's folder, which the frontend removes even
        # when this process is killed outright.
        os.environ[RANKS_IPC_PARENT_ENV] = orphaned[0]
    _exit_when_parent_dies(orphaned)
    shutdown_requested = threading.Event()

    def on_sigterm(signum: int, frame: object) -> None:
        shutdown_requested.set()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the frontend, which shuts us down
    config = EngineConfig.model_validate_json(config_json)
    cpu_binding.OWN_PROCESS = True
    proc: EngineCoreProc | None = None
    engine: Any = None
    try:
        if engine_core_cls is None:
            from tessera.engine.core import EngineCore

            engine_core_cls = EngineCore
        engine = engine_core_cls(config)
        ranks_folder = getattr(getattr(engine, "executor", None), "ipc_dir", None)
        if isinstance(ranks_folder, str):
            orphaned.append(ranks_folder)
        proc = EngineCoreProc(engine, input_addr, output_addr)
        proc.run(_ready_info(engine))
        engine.shutdown()
        proc.close()
    except SystemExit:
        if proc is not None:
            proc.close()
        _shutdown_quietly(engine)
        raise
    except BaseException:
        error = traceback.format_exc()
        logger.error("engine core failed:\n%s", error)
        if proc is None:
            # Failed while loading: the frontend is still waiting for READY; tell it why.
            proc = EngineCoreProc(_NoEngine(), input_addr, output_addr)
        proc.close(error)
        _shutdown_quietly(engine)  # after the frontend knows: its callers get their errors first
        sys.exit(1)


def _shutdown_quietly(engine: Any) -> None:
    """Release what the engine holds (its ranks, their IPC folder) on the way out of a failure."""
    if engine is not None:
        try:
            engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")


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
