"""The engine core's channel to its ranks: ZeroMQ, msgpack wire types (never pickle), heartbeats.

The leader binds one ROUTER socket (IPC for local ranks, TCP on ``TESSERA_RPC_PORT`` for pods);
each rank connects a DEALER whose identity is its rank. One I/O thread owns each socket (ZeroMQ
sockets are not thread-safe) and talks to its own process's threads through an inproc pair, so
a rank whose main thread is busy in a forward pass, or blocked in a collective, still answers
heartbeats, and still notices when its leader is gone.

Leader -> rank: WELCOME (the engine configuration), CALL (collective RPC), EXECUTE (a step's
SchedulerOutput), PING, SHUTDOWN, ABORT (the engine failed: exit non-zero at once). Rank -> leader: HELLO, READY, RESULT, OUTPUT (only the last
stage's TP rank 0), PONG, FATAL (a traceback, before the rank exits non-zero).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from tessera.engine import serialization

logger = logging.getLogger(__name__)

WELCOME, CALL, EXECUTE, PING = b"WELCOME", b"CALL", b"EXECUTE", b"PING"
SHUTDOWN, ABORT = b"SHUTDOWN", b"ABORT"
HELLO, READY, RESULT, OUTPUT, PONG, FATAL = b"HELLO", b"READY", b"RESULT", b"OUTPUT", b"PONG", b"FATAL"

HEARTBEAT_INTERVAL_S = 1.0
# A rank that sends nothing for this long is dead or stopped (SIGSTOP); so is a silent leader.
HEARTBEAT_TIMEOUT_S = float(os.environ.get("TESSERA_HEARTBEAT_TIMEOUT", "5"))
# A leader heard from once, then silent this long while its rank still loads, is gone too.
STARTUP_SILENCE_S = 6 * HEARTBEAT_TIMEOUT_S
# The largest message either end sends or accepts (ZeroMQ drops a peer that sends more).
MAX_MESSAGE_BYTES = 256 << 20
_WAKE = "inproc://tessera-rpc-wake"


def _encoded(kind: bytes, payload: Any) -> bytes:
    """``payload`` for the wire; one the other end would refuse fails here, where it is made."""
    data = serialization.encode(payload)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(
            f"a {kind.decode()} message of {len(data)} bytes passes the ranks' channel limit of {MAX_MESSAGE_BYTES}"
        )
    return data


def _identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class LeaderChannel:
    """The engine core's end: broadcasts to every rank, routes replies, watches heartbeats.

    ``on_message(rank, kind, payload)`` runs on the I/O thread for every message but PONG;
    ``on_failure(reason)`` runs once when a known rank falls silent.
    """

    def __init__(
        self,
        bind_addrs: list[str],
        world_size: int,
        on_message: Callable[[int, bytes, Any], None],
        on_failure: Callable[[str], None],
    ) -> None:
        self.world_size = world_size
        self._on_message, self._on_failure = on_message, on_failure
        self._zmq = zmq.Context()
        self._router = self._zmq.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a missing rank raises
        # A restarted rank reconnects under the same identity, often before the dead one's
        # connection is noticed closed (a killed pod's TCP never is): without the handover the
        # ROUTER silently drops the newcomer's messages, and its restart goes unseen.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.IPV6, 1)  # tcp://* on IPv6 and IPv4 (IPv4 alone where no IPv6)
        for addr in bind_addrs:
            self._router.bind(addr)
        self._wake_addr = f"{_WAKE}-{id(self)}"
        self._inbox = self._zmq.socket(zmq.PULL)
        self._inbox.bind(self._wake_addr)
        self._outbox = self._zmq.socket(zmq.PUSH)  # used by the engine core's thread only
        self._outbox.connect(self._wake_addr)
        self._send_lock = threading.Lock()
        self.last_seen: dict[int, float] = {}
        # Ranks held to a silence deadline, and its length: the heartbeat timeout once started,
        # STARTUP_SILENCE_S from joining until then (loading a model can starve a busy machine's
        # threads for seconds), none before joining (startup has its own timeout).
        self.watched: dict[int, float] = {}
        # Each rank's process, by the instance its first HELLO or PONG named: a heartbeat from
        # another process under the same rank is a rank restarted, never a rank alive.
        self.instances: dict[int, str] = {}
        self._closed = threading.Event()
        self._failed = False  # on_failure runs once
        self._thread = threading.Thread(target=self._loop, name="rank-channel", daemon=True)

    def start(self) -> LeaderChannel:
        """Start the I/O thread. Separate from construction: a rank may already be waiting, and
        its HELLO must not reach ``on_message`` before the owner holds this channel."""
        self._thread.start()
        return self

    # --- the engine core's side -----------------------------------------------------------------
    def send(self, ranks: list[int], kind: bytes, payload: Any) -> None:
        data = _encoded(kind, payload)
        with self._send_lock:
            self._outbox.send_multipart([b",".join(str(r).encode() for r in ranks), kind, data])

    def watch(self, rank: int, silence_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        """Hold ``rank`` to a deadline of ``silence_s`` without a message, from now on."""
        self.last_seen[rank] = time.monotonic()
        self.watched[rank] = silence_s

    def broadcast(self, kind: bytes, payload: Any) -> None:
        self.send(list(range(self.world_size)), kind, payload)

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            if self._thread.is_alive():
                self._thread.join(timeout=2)
            self._zmq.destroy(linger=0)

    # --- the I/O thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        next_ping = time.monotonic()
        lag = LagMeter()
        while not self._closed.is_set():
            events = dict(poller.poll(100))
            stalled = lag.measure()
            for rank in self.last_seen:  # asleep ourselves, we cannot blame a rank for silence
                self.last_seen[rank] += stalled
            if self._inbox in events:
                ranks, kind, data = self._inbox.recv_multipart()
                self._forward([int(r) for r in ranks.split(b",")], kind, data)
            if self._router in events:
                _drain(self._router, self._receive)
            now = time.monotonic()
            if now >= next_ping:
                next_ping = now + HEARTBEAT_INTERVAL_S
                self._forward(list(self.last_seen), PING, serialization.encode(None))
            silent = [r for r, limit in self.watched.items() if now - self.last_seen.get(r, now) > limit]
            if silent:
                limit = self.watched[silent[0]]
                self._fail(f"rank {silent[0]} stopped answering (no heartbeat for {limit:.0f} s)")

    def _fail(self, reason: str) -> None:
        if not self._failed:
            self._failed = True
            self._on_failure(reason)

    def _forward(self, ranks: list[int], kind: bytes, data: bytes) -> None:
        for rank in ranks:
            try:
                self._router.send_multipart([_identity(rank), kind, data], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if kind in (EXECUTE, CALL) and rank in self.watched:
                    # A rank that missed a step or a call would leave its peers waiting in a
                    # collective until it times out: fail now, naming it.
                    self._fail(
                        f"rank {rank} is unreachable: its {kind.decode()} message could not be sent ({exc})"
                    )
                else:  # not connected yet, or a ping: heartbeats judge that
                    logger.debug("cannot send %s to rank %d: %s", kind.decode(), rank, exc)

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            logger.warning("rank channel: dropped a message of %d frames", len(frames))
            return
        identity, kind, data = frames
        try:
            rank = int(identity.decode().removeprefix("rank-"))
            payload = serialization.decode(data, MAX_MESSAGE_BYTES)
        except Exception as exc:  # a malformed message is the sender's fault, never ours to die of
            logger.warning("rank channel: undecodable %r message: %s", kind[:16], exc)
            return
        if not 0 <= rank < self.world_size:
            logger.warning("rank channel: message from rank %d outside a world of %d", rank, self.world_size)
            return
        instance = payload.get("instance") if kind in (HELLO, PONG) and isinstance(payload, dict) else None
        if instance is not None and self.instances.setdefault(rank, str(instance)) != str(instance):
            self._fail(f"rank {rank} restarted (a new process joined): its group must restart as a whole")
            return
        self.last_seen[rank] = time.monotonic()
        if kind == PONG:
            return
        try:
            self._on_message(rank, kind, payload)
        except Exception:  # the I/O thread must outlive a handler's bug: fail the engine, loudly
            logger.exception("rank channel: handling %r from rank %d failed", kind[:16], rank)
            self._fail(f"the leader failed to handle a {kind[:16]!r} message from rank {rank}")


class WorkerLink:
    """A rank's end: messages from the leader arrive in ``inbox``; ``send`` replies.

    When the leader falls silent for longer than the heartbeat timeout (once this rank is ready;
    before, STARTUP_SILENCE_S from the leader's first answer) the process exits with status 1
    from the I/O thread, whatever the main thread is doing: no rank outlives its leader. A rank
    the leader started on its own machine (``parent_pid``) also exits as soon as that process is
    gone, even before the leader ever answered.
    """

    def __init__(self, addr: str, rank: int, parent_pid: int | None = None) -> None:
        self.rank = rank
        self._addr = addr
        self._parent_pid = parent_pid
        self.inbox: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self._zmq = zmq.Context()
        self._dealer = self._zmq.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, _identity(rank))
        self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._dealer.setsockopt(zmq.LINGER, 2000)
        self._dealer.setsockopt(zmq.IPV6, 1)  # a leader's name may resolve to IPv6 only
        self._dealer.connect(addr)
        self._wake_addr = f"{_WAKE}-{id(self)}"
        self._inbox_sock = self._zmq.socket(zmq.PULL)
        self._inbox_sock.bind(self._wake_addr)
        self._outbox = self._zmq.socket(zmq.PUSH)
        self._outbox.connect(self._wake_addr)
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._leader_seen: float | None = None
        # Tells this process from a replacement of it: in containers every rank may be pid 1.
        self._instance = uuid.uuid4().hex
        self._armed = False  # the strict leader-silence deadline holds once this rank is ready
        self._thread = threading.Thread(target=self._loop, name="leader-link", daemon=True)
        self._thread.start()

    def send(self, kind: bytes, payload: Any) -> None:
        data = _encoded(kind, payload)
        with self._send_lock:
            self._outbox.send_multipart([kind, data])

    def arm(self) -> None:
        """From now on the leader may be silent only the heartbeat timeout (while this rank loads,
        its main thread may hold the CPU and the GIL for long stretches: STARTUP_SILENCE_S)."""
        self._leader_seen = time.monotonic()
        self._armed = True

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=3)
        self._zmq.destroy(linger=1000)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._inbox_sock, zmq.POLLIN)
        next_beat = 0.0
        lag = LagMeter()
        while not self._closed.is_set():
            events = dict(poller.poll(100))
            stalled = lag.measure()
            if self._leader_seen is not None:  # asleep ourselves, we cannot blame the leader
                self._leader_seen += stalled
            if self._inbox_sock in events:
                self._dealer.send_multipart(self._inbox_sock.recv_multipart())
            if self._dealer in events:
                _drain(self._dealer, self._receive)
            now = time.monotonic()
            if now >= next_beat:  # HELLO until the leader answers, then heartbeats
                next_beat = now + HEARTBEAT_INTERVAL_S
                beat = HELLO if self._leader_seen is None else PONG
                self._dealer.send_multipart(
                    [beat, serialization.encode({"rank": self.rank, "instance": self._instance})]
                )
            silence_limit = HEARTBEAT_TIMEOUT_S if self._armed else STARTUP_SILENCE_S
            if self._leader_seen is not None and now - self._leader_seen > silence_limit:
                logger.error(
                    "rank %d: the leader is gone (silent for %.0f s); exiting", self.rank, silence_limit
                )
                os._exit(1)
            if self._parent_pid is not None and os.getppid() != self._parent_pid:
                logger.error("rank %d: the process that started it is gone; exiting", self.rank)
                if self._addr.startswith("ipc://"):  # its socket folder: nobody else is left to remove it
                    shutil.rmtree(os.path.dirname(self._addr.removeprefix("ipc://")), ignore_errors=True)
                os._exit(1)
        # What send() queued just before close() still goes out: a failing rank's last FATAL.
        while self._inbox_sock.poll(0):
            self._dealer.send_multipart(self._inbox_sock.recv_multipart())

    def _receive(self, frames: list[bytes]) -> None:
        self._leader_seen = time.monotonic()
        if len(frames) != 2:
            logger.warning("rank %d: dropped a message of %d frames from the leader", self.rank, len(frames))
            return
        kind, data = frames
        if kind == PING:
            return
        if kind == ABORT:  # handled here: the main thread may be stuck in a collective
            logger.error("rank %d: the engine failed; exiting", self.rank)
            os._exit(1)
        try:
            payload = serialization.decode(data, MAX_MESSAGE_BYTES)
        except Exception as exc:
            logger.error("rank %d: undecodable %r message from the leader: %s", self.rank, kind[:16], exc)
            self.inbox.put((FATAL, f"undecodable {kind[:16]!r} message: {exc}"))
            return
        self.inbox.put((kind, payload))


class LagMeter:
    """How long this thread was kept from running beyond its poll interval (a machine-wide stall:
    CPU or memory pressure stops every process, and no peer should be blamed for that)."""

    EXPECTED_S = 0.5

    def __init__(self) -> None:
        self._last = time.monotonic()

    def measure(self) -> float:
        now = time.monotonic()
        stalled = max(0.0, now - self._last - self.EXPECTED_S)
        self._last = now
        return stalled


def _drain(sock: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
    """Handle every frame already queued: after a stall, a backlog is proof of life, not silence."""
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        handle(frames)
