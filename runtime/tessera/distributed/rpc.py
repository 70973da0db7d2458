"""The engine core's channel to its ranks: ZeroMQ, msgpack wire types (never pickle), heartbeats.

The leader binds one ROUTER socket (IPC for local ranks, TCP on ``TESSERA_RPC_PORT`` for pods);
each rank connects a DEALER whose identity is its rank. One I/O thread owns each socket (ZeroMQ
sockets are not thread-safe) and talks to its own process's threads through an inproc pair, so
a rank whose main thread is busy in a forward pass, or blocked in a collective, still answers
heartbeats, and still notices when its leader is gone.

Leader -> rank: WELCOME (the engine configuration), CALL (collective RPC), EXECUTE (a step's
SchedulerOutput), PING, SHUTDOWN, ABORT (the engine failed: exit non-zero at once). Rank -> leader: HELLO, READY, RESULT, OUTPUT (only the last
stage's TP rank 0), PONG, FATAL (a traceback, before the rank exits non-zero).

Authentication (docs/SECURITY.md, "Rank traffic"): every connection is ZeroMQ CURVE (encrypted,
authenticated) with keys derived from the group's secret (``group_secret.GroupKeys``). A rank
connects only to a leader holding the group's server key; the leader's ZAP handler accepts only
the ranks' derived client keys and tags each session with the rank its key belongs to, and a
message is accepted only when its sender's identity is exactly ``rank-<that rank>``, of a known
kind, well formed, and allowed from that rank at that point (OUTPUT from the output rank only,
READY / RESULT / OUTPUT after its HELLO, heartbeats naming its process). Everything else is
counted in ``LeaderChannel.rejected`` and logged (rate-limited), never fatal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.z85 import decode as z85_decode

from tessera.distributed.group_secret import GroupKeys
from tessera.sampling_params import MAX_LOGPROBS
from tessera.topology import GROUP_SECRET_FILE_ENV
from tessera.wire import serialization
from tessera.wire.sched_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

WELCOME, CALL, EXECUTE, PING = b"WELCOME", b"CALL", b"EXECUTE", b"PING"
SHUTDOWN, ABORT = b"SHUTDOWN", b"ABORT"
HELLO, READY, RESULT, OUTPUT, PONG, FATAL = b"HELLO", b"READY", b"RESULT", b"OUTPUT", b"PONG", b"FATAL"

HEARTBEAT_INTERVAL_S = 1.0
# A rank that sends nothing for this long is dead or stopped (SIGSTOP); so is a silent leader.
HEARTBEAT_TIMEOUT_S = float(os.environ.get("TESSERA_HEARTBEAT_TIMEOUT", "5"))
# A leader heard from once, then silent this long while its rank still loads, is gone too.
STARTUP_SILENCE_S = 6 * HEARTBEAT_TIMEOUT_S
# The largest message the leader sends (a step's SchedulerOutput, a prompt of a million tokens)
# and a rank accepts (ZeroMQ drops a peer that sends more).
MAX_MESSAGE_BYTES = 256 << 20
# What a rank's reply may need beyond its per-sequence and per-token share (RESULT values,
# a FATAL's traceback, a few request ids).
REPLY_BASE_BYTES = 1 << 20
# A reply's share per sequence it samples (its request id, token, logprobs, a failure's reason)
# and per token it schedules (a prompt-logprobs entry of up to MAX_LOGPROBS alternatives): each
# is several times what msgpack packs them into.
REPLY_BYTES_PER_SEQ = 4096
REPLY_BYTES_PER_TOKEN = 64 + 32 * MAX_LOGPROBS
# What a leader accepts from ranks without an engine configuration (tests, a bare channel).
DEFAULT_REPLY_BYTES = 16 << 20
_WAKE = "inproc://tessera-rpc-wake"
_ZAP = "inproc://zeromq.zap.01"  # where libzmq asks a context's authenticator (RFC 27)
_ZAP_DOMAIN = b"tessera-ranks"
_RANK_IDENTITY = re.compile(rb"rank-(0|[1-9][0-9]*)")
# How often one reason for rejecting traffic is logged at most (a stranger retries every 100 ms).
REJECT_LOG_INTERVAL_S = 10.0


def reply_limit(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The largest message a rank may send its leader: an OUTPUT for ``max_num_seqs`` sampled
    sequences and ``max_num_batched_tokens`` scheduled tokens with every logprob asked for, far
    under MAX_MESSAGE_BYTES for any real engine (the defaults, 128 and 2048, give 2.9 MiB)."""
    limit = (
        REPLY_BASE_BYTES + max_num_seqs * REPLY_BYTES_PER_SEQ + max_num_batched_tokens * REPLY_BYTES_PER_TOKEN
    )
    return min(MAX_MESSAGE_BYTES, limit)


def _encoded(kind: bytes, payload: Any, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    """``payload`` for the wire; one the other end would refuse fails here, where it is made."""
    data = serialization.encode(payload)
    if len(data) > limit:
        raise ValueError(
            f"a {kind.decode()} message of {len(data)} bytes passes the ranks' channel limit of {limit}"
        )
    return data


def _well_formed(kind: bytes, payload: Any) -> bool:
    """Whether a rank's message has what its handler reads (anything else is dropped, counted)."""
    if not isinstance(payload, dict):
        return False
    if kind in (HELLO, PONG):
        return isinstance(payload.get("instance"), str) and bool(payload["instance"])
    if kind == READY:
        value = payload.get("max_model_len")
        return isinstance(value, int) and not isinstance(value, bool) and value > 0
    if kind == RESULT:
        return isinstance(payload.get("id"), int) and not isinstance(payload["id"], bool)
    if kind == OUTPUT:
        step = payload.get("step")
        return (
            isinstance(step, int)
            and not isinstance(step, bool)
            and isinstance(payload.get("output"), ModelRunnerOutput)
        )
    return kind == FATAL


def _identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class LeaderChannel:
    """The engine core's end: broadcasts to every rank, routes replies, watches heartbeats.

    ``on_message(rank, kind, payload)`` runs on the I/O thread for every accepted message but
    PONG; ``on_failure(reason)`` runs once when a known rank falls silent. Only holders of the
    group's secret (``keys``) get through the CURVE handshake; of their messages, only those of
    ``output_rank`` may be OUTPUT, and no frame from ranks is larger than ``max_inbound_bytes``.
    ``rejected`` counts, by reason, every connection and message refused.
    """

    def __init__(
        self,
        bind_addrs: list[str],
        world_size: int,
        on_message: Callable[[int, bytes, Any], None],
        on_failure: Callable[[str], None],
        keys: GroupKeys,
        output_rank: int | None = None,
        max_inbound_bytes: int = DEFAULT_REPLY_BYTES,
    ) -> None:
        self.world_size = world_size
        self.output_rank = world_size - 1 if output_rank is None else output_rank
        self.max_inbound_bytes = max_inbound_bytes
        self._on_message, self._on_failure = on_message, on_failure
        self.rejected: Counter[str] = Counter()
        self._rejects_logged: dict[str, float] = {}
        self._zmq = zmq.Context()
        # The context's authenticator, bound before any socket that asks it: libzmq lets every
        # CURVE client in when no handler is bound. Answered by the I/O thread.
        self._zap = self._zmq.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP)
        self._rank_of_key = {z85_decode(keys.rank(rank)[0]): rank for rank in range(world_size)}
        self._sessions = 0  # numbers each authenticated connection (a ZAP reply's User-Id)
        self.session_of: dict[int, str] = {}  # the connection each rank was last heard on
        self._router = self._zmq.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a missing rank raises
        # A restarted rank reconnects under the same identity, often before the dead one's
        # connection is noticed closed (a killed pod's TCP never is): without the handover the
        # ROUTER silently drops the newcomer's messages, and its restart goes unseen. Only a
        # holder of the group's secret gets that far (the handshake comes first); a connection
        # taking a rank's place is logged, and one from another process fails the group.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.CURVE_SERVER, 1)
        self._router.setsockopt(zmq.CURVE_SECRETKEY, keys.server[1])
        self._router.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_inbound_bytes)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.IPV6, 1)  # tcp://* on IPv6 and IPv4 (IPv4 alone where no IPv6)
        # Handshakes that fail before the authenticator is asked (no CURVE, the wrong server key).
        self._monitor = self._router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
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
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_ping = time.monotonic()
        lag = LagMeter()
        while not self._closed.is_set():
            events = dict(poller.poll(100))
            stalled = lag.measure()
            for rank in self.last_seen:  # asleep ourselves, we cannot blame a rank for silence
                self.last_seen[rank] += stalled
            if self._zap in events:
                self._authenticate(self._zap.recv_multipart())
            if self._monitor in events:
                while self._monitor.poll(0):
                    self._monitor.recv_multipart()
                    self._reject(
                        "handshake failed", "a peer without the group's keys (no CURVE, or another secret)"
                    )
            if self._inbox in events:
                ranks, kind, data = self._inbox.recv_multipart()
                self._forward([int(r) for r in ranks.split(b",")], kind, data)
            if self._router in events:
                _drain(self._router, self._receive, copy=False)
            now = time.monotonic()
            if now >= next_ping:
                next_ping = now + HEARTBEAT_INTERVAL_S
                self._forward(list(self.last_seen), PING, serialization.encode(None))
            silent = [r for r, limit in self.watched.items() if now - self.last_seen.get(r, now) > limit]
            if silent:
                limit = self.watched[silent[0]]
                self._fail(f"rank {silent[0]} stopped answering (no heartbeat for {limit:.0f} s)")

    def _authenticate(self, request: list[bytes]) -> None:
        """Answer libzmq's ZAP request for one connection: only the ranks' derived keys pass, each
        session tagged ``rank-<r> <session>`` (its messages' User-Id)."""
        version, request_id = [*request, b"", b""][:2]  # a REP socket must answer every request
        rank = None
        if len(request) >= 7 and request[2] == _ZAP_DOMAIN and request[5] == b"CURVE":
            rank = self._rank_of_key.get(request[6])
        if rank is None:
            self._reject("unknown key", f"a connection from {request[3][:64]!r} with a key of no rank")
            self._zap.send_multipart([version, request_id, b"400", b"unknown key", b"", b""])
            return
        self._sessions += 1
        user_id = f"rank-{rank} {self._sessions}".encode()
        self._zap.send_multipart([version, request_id, b"200", b"OK", user_id, b""])

    def _reject(self, reason: str, detail: str) -> None:
        """Count a refused connection or message; log each reason at most every REJECT_LOG_INTERVAL_S."""
        self.rejected[reason] += 1
        now = time.monotonic()
        if now - self._rejects_logged.get(reason, -REJECT_LOG_INTERVAL_S) >= REJECT_LOG_INTERVAL_S:
            self._rejects_logged[reason] = now
            logger.warning(
                "rank channel: rejected (%s, %d so far): %s", reason, self.rejected[reason], detail
            )

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

    def _sender(self, frames: list[zmq.Frame]) -> tuple[int, str] | None:
        """The rank a message comes from and its session, or None (counted) if it may not speak."""
        identity = frames[0].bytes
        try:
            key_rank, session = str(frames[1].get("User-Id")).split(" ")
        except (zmq.ZMQError, ValueError):  # not authenticated by this channel's ZAP handler
            self._reject("unauthenticated", f"a message from {identity[:32]!r} without a session")
            return None
        match = _RANK_IDENTITY.fullmatch(identity)
        if match is None or int(match[1]) >= self.world_size:
            self._reject(
                "bad identity", f"a message from {identity[:32]!r}, not rank-<0..{self.world_size - 1}>"
            )
            return None
        rank = int(match[1])
        if f"rank-{rank}" != key_rank:
            self._reject("identity of another rank", f"{key_rank}'s key spoke as rank {rank}")
            return None
        return rank, session

    def _receive(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 3:
            self._reject("frame count", f"a message of {len(frames)} frames")
            return
        sender = self._sender(frames)
        if sender is None:
            return
        rank, session = sender
        kind = frames[1].bytes
        try:
            payload = serialization.decode(frames[2].buffer, self.max_inbound_bytes)
        except Exception as exc:  # a malformed message is the sender's fault, never ours to die of
            self._reject("undecodable", f"a {kind[:16]!r} message from rank {rank}: {exc}")
            return
        if kind not in (HELLO, PONG, READY, RESULT, OUTPUT, FATAL) or not _well_formed(kind, payload):
            self._reject(
                "malformed", f"a {kind[:16]!r} message from rank {rank} that is no well-formed rank message"
            )
            return
        if kind == OUTPUT and rank != self.output_rank:
            self._reject(
                "output from another rank", f"OUTPUT from rank {rank}; only rank {self.output_rank} samples"
            )
            return
        if kind in (READY, RESULT, OUTPUT) and rank not in self.instances:
            self._reject(
                "before hello", f"a {kind.decode()} message from rank {rank}, which has not said HELLO"
            )
            return
        instance = payload["instance"] if kind in (HELLO, PONG) else None
        if instance is not None and self.instances.setdefault(rank, instance) != instance:
            self._fail(f"rank {rank} restarted (a new process joined): its group must restart as a whole")
            return
        previous = self.session_of.get(rank)
        if previous != session:
            if previous is not None:  # the same process (it named its instance), or a FATAL/reply
                logger.warning(
                    "rank channel: rank %d connected again (session %s after %s)", rank, session, previous
                )
            self.session_of[rank] = session
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

    def __init__(self, addr: str, rank: int, keys: GroupKeys, parent_pid: int | None = None) -> None:
        self.rank = rank
        self._addr = addr
        self._parent_pid = parent_pid
        # What the leader accepts from a rank (its ROUTER drops a connection that sends more):
        # set from the engine configuration once it arrives (``limit_replies``).
        self.max_send_bytes = DEFAULT_REPLY_BYTES
        self.inbox: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self._zmq = zmq.Context()
        self._dealer = self._zmq.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, _identity(rank))
        # Only a leader that holds the group's server key completes the handshake, and only this
        # rank's key makes the leader take this connection for this rank.
        public_key, secret_key = keys.rank(rank)
        self._dealer.setsockopt(zmq.CURVE_SERVERKEY, keys.server[0])
        self._dealer.setsockopt(zmq.CURVE_PUBLICKEY, public_key)
        self._dealer.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
        self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._dealer.setsockopt(zmq.LINGER, 2000)
        self._dealer.setsockopt(zmq.IPV6, 1)  # a leader's name may resolve to IPv6 only
        # A leader that holds another secret (or none) fails every handshake: say so, not just wait.
        self._monitor = self._dealer.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self._refusals_logged = -REJECT_LOG_INTERVAL_S
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
        data = _encoded(kind, payload, self.max_send_bytes)
        with self._send_lock:
            self._outbox.send_multipart([kind, data])

    def limit_replies(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Hold this rank's replies to what its leader accepts (``reply_limit``), so one too
        large fails here, named, instead of being dropped with the connection on the way."""
        self.max_send_bytes = reply_limit(max_num_seqs, max_num_batched_tokens)

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
        poller.register(self._monitor, zmq.POLLIN)
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
            if self._monitor in events:
                self._handshake_failed()
            now = time.monotonic()
            if now >= next_beat:  # HELLO until the leader answers, then heartbeats
                next_beat = now + HEARTBEAT_INTERVAL_S
                beat = HELLO if self._leader_seen is None else PONG
                with contextlib.suppress(zmq.Again):  # queued past the high-water mark: no use
                    self._dealer.send_multipart(
                        [beat, serialization.encode({"rank": self.rank, "instance": self._instance})],
                        zmq.NOBLOCK,
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

    def _handshake_failed(self) -> None:
        while self._monitor.poll(0):
            self._monitor.recv_multipart()
        now = time.monotonic()
        if now - self._refusals_logged >= REJECT_LOG_INTERVAL_S:
            self._refusals_logged = now
            logger.error(
                "rank %d: the handshake with the leader at %s failed: it holds another group secret, "
                "or is no Tessera leader (%s names this rank's secret file)",
                self.rank, self._addr, GROUP_SECRET_FILE_ENV,
            )  # fmt: skip

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


def _drain(sock: zmq.Socket, handle: Callable[[Any], None], copy: bool = True) -> None:
    """Handle every frame already queued: after a stall, a backlog is proof of life, not silence.
    With ``copy=False`` the handler gets zmq.Frame objects (which carry the session's User-Id)."""
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return
        handle(frames)
