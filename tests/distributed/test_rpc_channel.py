"""The rank channel's watchdogs: a malformed message is dropped, not fatal; a stalled watchdog
blames nobody for its own sleep."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from tessera.distributed import rpc
from tessera.ports import free_port
from tessera.wire import serialization
from tessera.wire.sched_output import ModelRunnerOutput
from tests.distributed.channel_peers import KEYS, rank_peer


def test_a_lag_meter_reports_only_time_beyond_its_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(rpc.time, "monotonic", lambda: now[0])
    meter = rpc.LagMeter()
    now[0] += rpc.LagMeter.EXPECTED_S - 0.1
    assert meter.measure() == 0.0  # within its interval
    now[0] += rpc.LagMeter.EXPECTED_S + 0.4
    assert meter.measure() == pytest.approx(0.4)  # only the time beyond it, counted from the last measure


def test_malformed_frames_from_a_peer_are_dropped_and_the_channel_goes_on(tmp_path) -> None:
    received: list[tuple[int, bytes, object]] = []
    failures: list[str] = []
    got = threading.Event()

    def on_message(rank: int, kind: bytes, payload: object) -> None:
        if kind != rpc.HELLO:
            received.append((rank, kind, payload))
            got.set()

    addr = f"ipc://{tmp_path}/rpc"
    channel = rpc.LeaderChannel([addr], 2, on_message, failures.append, KEYS).start()
    context = zmq.Context()
    peer = rank_peer(context, addr, 1)
    ready = {"rank": 1, "max_model_len": 64}
    try:
        peer.send_multipart([b"HELLO", serialization.encode({"rank": 1, "instance": "a"})])
        peer.send_multipart([b"READY", b"\xc1not msgpack"])  # undecodable
        peer.send_multipart([b"READY"])  # wrong frame count
        peer.send_multipart([b"READY", serialization.encode({"rank": 1})])  # not what READY holds
        peer.send_multipart([b"READY", serialization.encode(ready)])
        assert got.wait(10)
        assert received == [(1, b"READY", ready)] and failures == []
        assert channel.rejected == {"undecodable": 1, "frame count": 1, "malformed": 1}
    finally:
        peer.close(0)
        context.term()
        channel.close()


def test_messages_wait_for_start_and_a_handler_bug_fails_the_engine_not_the_channel(tmp_path) -> None:
    """A pod rank can say HELLO before the leader holds its channel: nothing is handled before
    start(). A handler that raises must not kill the I/O thread (the leader would go deaf and
    every rank would wait forever): the engine is failed instead, and later messages still arrive."""
    received: list[tuple[int, bytes, object]] = []
    failures: list[str] = []
    got = threading.Event()

    def on_message(rank: int, kind: bytes, payload: object) -> None:
        if kind == b"HELLO":
            raise RuntimeError("a handler's bug")
        received.append((rank, kind, payload))
        got.set()

    addr = f"ipc://{tmp_path}/rpc"
    channel = rpc.LeaderChannel([addr], 2, on_message, failures.append, KEYS)
    context = zmq.Context()
    peer = rank_peer(context, addr, 1)
    ready = {"rank": 1, "max_model_len": 64}
    try:
        peer.send_multipart([b"HELLO", serialization.encode({"instance": "a"})])
        peer.send_multipart([b"READY", serialization.encode(ready)])
        time.sleep(0.3)
        assert received == [] and failures == []  # not started: nothing handled yet
        channel.start()
        assert got.wait(10)
        assert received == [(1, b"READY", ready)]
        assert len(failures) == 1 and "HELLO" in failures[0]
    finally:
        peer.close(0)
        context.term()
        channel.close()


def test_a_step_that_cannot_reach_a_started_rank_fails_the_engine_at_once(tmp_path) -> None:
    """A rank that missed an EXECUTE would leave its peers in a collective until its timeout
    (minutes): the leader fails the engine when the send fails, before any heartbeat deadline."""
    failures: list[str] = []
    addr = f"ipc://{tmp_path}/rpc"
    channel = rpc.LeaderChannel([addr], 2, lambda *_: None, failures.append, KEYS).start()
    context = zmq.Context()
    peer = rank_peer(context, addr, 1)
    try:
        peer.send_multipart([b"HELLO", serialization.encode({"instance": "a"})])
        deadline = time.monotonic() + 10
        while 1 not in channel.last_seen:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        channel.watch(1)
        channel.send([1], rpc.PING, None)  # to an unstarted rank or as a ping: never fatal
        peer.close(0)  # the rank's connection is gone
        started = time.monotonic()
        while not failures and time.monotonic() - started < rpc.HEARTBEAT_TIMEOUT_S / 2:
            channel.send([1], rpc.EXECUTE, {"step": 1})
            time.sleep(0.1)
        assert len(failures) == 1 and "rank 1 is unreachable: its EXECUTE message" in failures[0]
    finally:
        context.term()
        channel.close()


def test_a_rank_reaches_its_leader_over_ipv6_and_ipv4() -> None:
    """Pods on IPv6-only clusters resolve the leader's name to an IPv6 address."""
    got: list[int] = []
    arrived = threading.Event()

    def on_message(rank: int, kind: bytes, payload: object) -> None:
        got.append(rank)
        if len(got) == 2:
            arrived.set()

    port = free_port()
    channel = rpc.LeaderChannel([f"tcp://*:{port}"], 3, on_message, lambda reason: None, KEYS).start()
    links = [
        rpc.WorkerLink(f"tcp://{host}:{port}", rank, KEYS) for rank, host in ((1, "[::1]"), (2, "127.0.0.1"))
    ]
    try:
        assert arrived.wait(10), f"only ranks {got} said HELLO"
        assert sorted(set(got)) == [1, 2]
    finally:
        for link in links:
            link.close()
        channel.close()


def test_a_message_up_to_the_channels_limit_arrives_and_a_larger_one_fails_at_its_sender(tmp_path) -> None:
    """One limit for both ends: a message under it is delivered whole (past the serializer's own
    default), one over it raises where it is sent instead of vanishing on the way."""
    limit = serialization.DEFAULT_MAX_BYTES + 4096
    received: list[tuple[int, bytes, object]] = []
    got = threading.Event()

    def on_message(rank: int, kind: bytes, payload: object) -> None:
        if kind == rpc.OUTPUT:  # not the link's HELLOs
            received.append((rank, kind, payload))
            got.set()

    addr = f"ipc://{tmp_path}/rpc"
    channel = rpc.LeaderChannel([addr], 2, on_message, lambda reason: None, KEYS, max_inbound_bytes=limit)
    channel.start()
    link = rpc.WorkerLink(addr, 1, KEYS)
    link.max_send_bytes = limit
    try:
        wait_for_hello = time.monotonic() + 10
        while 1 not in channel.instances:  # OUTPUT is taken only from a rank that said HELLO
            assert time.monotonic() < wait_for_hello
            time.sleep(0.05)
        big = ModelRunnerOutput(["x" * (serialization.DEFAULT_MAX_BYTES + 1024)], [1])
        link.send(rpc.OUTPUT, {"step": 0, "output": big})
        assert got.wait(30)
        assert received[0][:2] == (1, rpc.OUTPUT) and received[0][2] == {"step": 0, "output": big}
        with pytest.raises(ValueError, match=r"OUTPUT message of \d+ bytes passes the ranks' channel limit"):
            link.send(rpc.OUTPUT, {"output": b"x" * limit})
    finally:
        link.close()
        channel.close()


def test_a_replacement_rank_whose_first_word_is_a_heartbeat_fails_the_group(tmp_path) -> None:
    """A restarted rank process (docker restart, a supervisor) may be pinged before it says HELLO,
    and answer PONG as if it were the dead one: the instance it names tells them apart."""
    failures: list[str] = []
    addr = f"ipc://{tmp_path}/rpc"
    channel = rpc.LeaderChannel([addr], 2, lambda *_: None, failures.append, KEYS).start()
    context = zmq.Context()
    first = rank_peer(context, addr, 1)
    replacement = None
    try:
        first.send_multipart([b"HELLO", serialization.encode({"rank": 1, "instance": "first"})])
        first.send_multipart([b"PONG", serialization.encode({"rank": 1, "instance": "first"})])
        deadline = time.monotonic() + 10
        while channel.instances.get(1) != "first":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert failures == []
        first.close(0)  # killed
        replacement = rank_peer(context, addr, 1)
        replacement.send_multipart([b"PONG", serialization.encode({"rank": 1, "instance": "second"})])
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert failures == ["rank 1 restarted (a new process joined): its group must restart as a whole"]
    finally:
        for peer in (first, replacement):
            if peer is not None:
                peer.close(0)
        context.term()
        channel.close()


def test_a_rank_that_joined_is_watched_with_the_startup_allowance_until_ready() -> None:
    """A rank that dies while it loads fails the group within STARTUP_SILENCE_S, not at the
    startup timeout (15 min) meant for pods that have not arrived."""
    from tessera.executor.distributed import DistributedExecutor

    class Channel:
        def __init__(self) -> None:
            self.watched: dict[int, float] = {}
            self.sent: list[bytes] = []

        def watch(self, rank: int, silence_s: float = rpc.HEARTBEAT_TIMEOUT_S) -> None:
            self.watched[rank] = silence_s

        def send(self, ranks: list[int], kind: bytes, payload: object) -> None:
            self.sent.append(kind)

    executor = DistributedExecutor.__new__(DistributedExecutor)
    channel = Channel()
    executor.channel, executor.world_size, executor._instances, executor._welcome = channel, 2, {}, {}  # type: ignore[assignment]
    executor._on_hello(1, "a")
    assert channel.watched == {1: rpc.STARTUP_SILENCE_S} and channel.sent == []
    executor._on_hello(1, "a")  # HELLO repeated until the leader answers: nothing new
    executor._on_hello(0, "b")
    assert channel.sent == [rpc.WELCOME] and channel.watched[0] == rpc.STARTUP_SILENCE_S
