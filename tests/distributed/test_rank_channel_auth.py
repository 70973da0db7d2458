"""Rank traffic is the group's alone: a peer without the group's secret (another secret, no
CURVE, a look-alike identity) cannot kill the group, read its broadcasts or forge a rank's
words, and is counted; a rank's key speaks only as that rank; OUTPUT comes only from the output
rank, replies only after a HELLO, liveness only from heartbeats that name their process; frames
towards the leader are capped; the rendezvous meets only holders of the secret."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from tessera.distributed import parallel_state, rpc
from tessera.distributed.group_secret import (
    GroupKeys,
    GroupSecretError,
    read_group_secret,
    write_group_secret,
)
from tessera.ports import free_port
from tessera.topology import DEFAULT_GROUP_SECRET_FILE, GROUP_SECRET_FILE_ENV
from tessera.wire import serialization
from tessera.wire.sched_output import ModelRunnerOutput
from tests.distributed.channel_peers import KEYS, OTHER_KEYS, rank_peer, wait_until

REPO = Path(__file__).resolve().parents[2]


class Leader:
    """A LeaderChannel over real sockets and what it handed its owner."""

    def __init__(self, addr: str, world_size: int, output_rank: int | None = None, **kwargs: object) -> None:
        self.messages: list[tuple[int, bytes, object]] = []
        self.failures: list[str] = []
        self.channel = rpc.LeaderChannel(
            [addr],
            world_size,
            self._on_message,
            self.failures.append,
            KEYS,
            output_rank=output_rank,
            **kwargs,
        ).start()

    def _on_message(self, rank: int, kind: bytes, payload: object) -> None:
        self.messages.append((rank, kind, payload))

    def kinds(self, rank: int) -> list[bytes]:
        return [kind for r, kind, _ in self.messages if r == rank]


def encode(payload: object) -> bytes:
    return serialization.encode(payload)


def hello(instance: str) -> bytes:
    return encode({"rank": 1, "instance": instance})


def forgeries(rank: int) -> list[list[bytes]]:
    """Everything a rank may say, made up: each would fail or mislead the group if taken."""
    output = ModelRunnerOutput(["cmpl-victim"], [666])
    return [
        [rpc.HELLO, hello("intruder")],  # another process under a joined rank: fails the group
        [rpc.PONG, hello("intruder")],
        [rpc.READY, encode({"rank": rank, "max_model_len": 1})],
        [rpc.RESULT, encode({"id": 0, "rank": rank, "value": 1})],
        [rpc.OUTPUT, encode({"step": 0, "output": output})],
        [rpc.FATAL, encode({"rank": rank, "error": "forged"})],
        [rpc.READY, b"\xc1 not msgpack"],
    ]


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_strangers_cannot_kill_read_or_forge_and_are_counted(tmp_path: Path, transport: str) -> None:
    port = free_port()
    addr = f"ipc://{tmp_path}/rpc" if transport == "ipc" else f"tcp://127.0.0.1:{port}"
    leader = Leader(addr if transport == "ipc" else f"tcp://*:{port}", 2)
    link = rpc.WorkerLink(addr, 1, KEYS)  # the genuine rank 1
    context = zmq.Context()
    strangers = [
        rank_peer(context, addr, 1, keys=None),  # no CURVE at all, rank 1's exact identity
        rank_peer(context, addr, 1, keys=None, identity=b"rank-01"),  # a look-alike of rank 1
        rank_peer(context, addr, 1, keys=OTHER_KEYS),  # CURVE with another secret's keys
    ]
    # The worst case of a stranger: it knows the leader's public key (it is not secret in
    # CURVE's design) and offers a key of its own.
    public, secret = zmq.curve_keypair()
    knows_server = context.socket(zmq.DEALER)
    knows_server.setsockopt(zmq.IDENTITY, b"rank-1")
    knows_server.setsockopt(zmq.LINGER, 0)
    knows_server.setsockopt(zmq.CURVE_SERVERKEY, KEYS.server[0])
    knows_server.setsockopt(zmq.CURVE_PUBLICKEY, public)
    knows_server.setsockopt(zmq.CURVE_SECRETKEY, secret)
    knows_server.connect(addr)
    strangers.append(knows_server)
    try:
        wait_until(lambda: 1 in leader.channel.instances, what="HELLO from the genuine rank")
        genuine = leader.channel.instances[1]
        for stranger in strangers:
            for frames in forgeries(1):
                # A DEALER queues only towards a connection whose handshake completed: none does.
                with contextlib.suppress(zmq.Again):
                    stranger.send_multipart(frames, zmq.NOBLOCK)
        wait_until(
            lambda: (
                leader.channel.rejected["handshake failed"] >= 3
                and leader.channel.rejected["unknown key"] >= 1
            ),
            what="rejected handshakes",
        )
        leader.channel.broadcast(rpc.EXECUTE, {"step": 7, "output": "every user's prompt tokens"})
        kind, payload = link.inbox.get(timeout=10)
        assert (kind, payload) == (rpc.EXECUTE, {"step": 7, "output": "every user's prompt tokens"})
        time.sleep(1.5)  # a ping or two more, for anyone who could get them
        for stranger in strangers:
            assert stranger.poll(0) == 0, "a stranger received the leader's traffic"
        assert leader.failures == []
        assert leader.channel.instances == {1: genuine}
        assert leader.kinds(1) == [rpc.HELLO]  # nothing forged reached the executor
        assert leader.kinds(0) == []
        # The genuine rank still works, and its reply is taken.
        link.send(rpc.READY, {"rank": 1, "max_model_len": 64})
        wait_until(lambda: rpc.READY in leader.kinds(1), what="the genuine READY")
        assert leader.failures == []
    finally:
        for stranger in strangers:
            stranger.close(0)
        context.term()
        link.close()
        leader.channel.close()


def test_a_ranks_key_speaks_only_as_that_rank(tmp_path: Path) -> None:
    """Every key is derived per rank: rank 2's key under rank 1's identity, or under a look-alike
    identity, is refused (counted), never taken for rank 1."""
    addr = f"ipc://{tmp_path}/rpc"
    leader = Leader(addr, 3)
    context = zmq.Context()
    as_other = rank_peer(context, addr, 2, identity=b"rank-1")
    look_alike = rank_peer(context, addr, 1, identity=b"rank-01")
    outside = rank_peer(context, addr, 1, identity=b"rank-3")
    try:
        for peer in (as_other, look_alike, outside):
            peer.send_multipart([rpc.HELLO, hello("x")])
            peer.send_multipart([rpc.FATAL, encode({"error": "forged"})])
        wait_until(
            lambda: (
                leader.channel.rejected["identity of another rank"] >= 2
                and leader.channel.rejected["bad identity"] >= 4
            ),
            what="rejections",
        )
        assert leader.messages == [] and leader.failures == [] and leader.channel.instances == {}
    finally:
        for peer in (as_other, look_alike, outside):
            peer.close(0)
        context.term()
        leader.channel.close()


def test_output_only_from_the_output_rank_replies_only_after_hello(tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/rpc"
    leader = Leader(addr, 4, output_rank=2)  # tp 2 x pp 2: the last stage's TP rank 0
    context = zmq.Context()
    rank1, rank2 = rank_peer(context, addr, 1), rank_peer(context, addr, 2)
    output = {"step": 0, "output": ModelRunnerOutput(["cmpl-1"], [5])}
    try:
        rank2.send_multipart([rpc.READY, encode({"rank": 2, "max_model_len": 1})])  # before its HELLO
        rank2.send_multipart([rpc.RESULT, encode({"id": 0, "value": 1})])
        rank2.send_multipart([rpc.OUTPUT, encode(output)])
        wait_until(lambda: leader.channel.rejected["before hello"] == 3, what="replies refused before HELLO")
        rank1.send_multipart([rpc.HELLO, hello("one")])
        rank1.send_multipart([rpc.OUTPUT, encode(output)])  # a rank that does not sample
        wait_until(lambda: leader.channel.rejected["output from another rank"] == 1, what="OUTPUT refused")
        rank2.send_multipart([rpc.HELLO, hello("two")])
        rank2.send_multipart([rpc.OUTPUT, encode(output)])
        wait_until(lambda: rpc.OUTPUT in leader.kinds(2), what="the output rank's OUTPUT")
        assert leader.kinds(1) == [rpc.HELLO] and leader.kinds(2) == [rpc.HELLO, rpc.OUTPUT]
        assert leader.failures == []
    finally:
        rank1.close(0)
        rank2.close(0)
        context.term()
        leader.channel.close()


def test_a_heartbeat_without_its_instance_keeps_no_rank_alive(tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/rpc"
    leader = Leader(addr, 2)
    context = zmq.Context()
    peer = rank_peer(context, addr, 1)
    try:
        peer.send_multipart([rpc.HELLO, hello("one")])
        wait_until(lambda: 1 in leader.channel.instances, what="HELLO")
        leader.channel.watch(1, 1.0)
        started = time.monotonic()
        while not leader.failures and time.monotonic() - started < 5:
            peer.send_multipart([rpc.PONG, encode({"rank": 1})])  # a stopped rank's stand-in
            time.sleep(0.1)
        assert leader.failures == ["rank 1 stopped answering (no heartbeat for 1 s)"]
        assert leader.channel.rejected["malformed"] >= 5
    finally:
        peer.close(0)
        context.term()
        leader.channel.close()


def test_frames_towards_the_leader_are_capped_and_an_oversized_one_is_not_fatal(tmp_path: Path) -> None:
    assert rpc.reply_limit(128, 2048) < 4 << 20  # the defaults: a few MiB, not 256
    assert rpc.reply_limit(1024, 65536) < rpc.MAX_MESSAGE_BYTES
    addr = f"ipc://{tmp_path}/rpc"
    leader = Leader(addr, 2, max_inbound_bytes=64 << 10)
    context = zmq.Context()
    peer = rank_peer(context, addr, 1)
    try:
        peer.send_multipart([rpc.HELLO, hello("one")])
        wait_until(lambda: 1 in leader.channel.instances, what="HELLO")
        peer.send_multipart([rpc.FATAL, b"x" * (1 << 20)])  # ZeroMQ drops the connection instead
        peer.send_multipart([rpc.READY, encode({"rank": 1, "max_model_len": 64})])  # over a new one
        wait_until(lambda: rpc.READY in leader.kinds(1), what="READY after the oversized frame")
        assert leader.kinds(1) == [rpc.HELLO, rpc.READY] and leader.failures == []
    finally:
        peer.close(0)
        context.term()
        leader.channel.close()
    link_limit = rpc.WorkerLink(addr, 1, KEYS)
    try:
        link_limit.limit_replies(4, 16)
        with pytest.raises(ValueError, match="passes the ranks' channel limit"):
            link_limit.send(rpc.OUTPUT, {"output": b"x" * rpc.reply_limit(4, 16)})
    finally:
        link_limit.close()


def test_without_a_readable_secret_a_pod_refuses_to_start_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tessera.config import EngineConfig
    from tessera.executor.distributed import RemoteRanksExecutor
    from tessera.topology import ParallelLayout, Topology
    from tessera.worker.worker_proc import run_worker

    missing = tmp_path / "absent"
    with pytest.raises(GroupSecretError, match=f"{missing}.*{GROUP_SECRET_FILE_ENV}"):
        read_group_secret({GROUP_SECRET_FILE_ENV: str(missing)})
    if not os.path.exists(DEFAULT_GROUP_SECRET_FILE):
        with pytest.raises(GroupSecretError, match=f"{DEFAULT_GROUP_SECRET_FILE}.*{GROUP_SECRET_FILE_ENV}"):
            read_group_secret({})
    short = tmp_path / "short"
    short.write_bytes(b"guessable")
    with pytest.raises(GroupSecretError, match="has 9 bytes"):
        read_group_secret({GROUP_SECRET_FILE_ENV: str(short)})
    environ = {"TESSERA_TP_SIZE": "2", "TESSERA_TP_RANK": "1", GROUP_SECRET_FILE_ENV: str(missing)}
    with caplog.at_level(logging.ERROR, logger="tessera.worker"):
        assert run_worker(environ) == 2
    assert str(missing) in caplog.text and GROUP_SECRET_FILE_ENV in caplog.text
    layout = ParallelLayout(tensor_parallel_size=2)
    config = EngineConfig(model=str(tmp_path), parallel=layout)
    os.environ[GROUP_SECRET_FILE_ENV] = str(missing)
    try:
        with pytest.raises(GroupSecretError, match=str(missing)):
            RemoteRanksExecutor(config, Topology(layout=layout, rpc_port=free_port()))
    finally:
        del os.environ[GROUP_SECRET_FILE_ENV]


def test_a_local_leaders_secret_is_random_and_private(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = write_group_secret(str(tmp_path / "a")), write_group_secret(str(tmp_path / "b"))
    assert os.stat(first).st_mode & 0o777 == 0o600
    secrets_read = [read_group_secret({GROUP_SECRET_FILE_ENV: path}) for path in (first, second)]
    assert len(secrets_read[0]) == 32 and secrets_read[0] != secrets_read[1]
    assert GroupKeys(secrets_read[0]).server != GroupKeys(secrets_read[1]).server
    assert "secret" not in repr(GroupKeys(secrets_read[0])).replace("<secret>", "")


def test_the_rendezvous_listens_only_on_the_leaders_address() -> None:
    port = free_port()
    sock = parallel_state.listen_socket("127.0.0.1", port)
    try:
        assert sock.getsockname()[:2] == ("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        sock.close()


def test_a_stranger_cannot_join_the_gloo_group_and_the_ranks_meet_unharmed() -> None:
    """Real processes: rank 0 serves the store, strangers connect to it and try to join as rank 1
    (no key prefix, a guessed one) before the genuine rank 1 arrives; the genuine ranks meet and
    all-reduce 1 + 2, the strangers never complete the rendezvous."""
    port = free_port()
    env = {**os.environ, "TESSERA_DIST_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    secret = "the group's secret for the rendezvous test"

    def start(*args: str, timeout_s: float = 40) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.rendezvous_peer", *args],
            cwd=REPO,
            env={**env, "RENDEZVOUS_TIMEOUT_S": str(timeout_s)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    rank0 = start("rank", "0", secret)
    guessed = GroupKeys(b"a guess at the group's secret!!!").rendezvous_prefix
    strangers = [start("stranger", "", timeout_s=15), start("stranger", guessed, timeout_s=15)]
    procs = [rank0, *strangers]
    try:
        time.sleep(4)  # the strangers are at the store, waiting for a rank 0 of their own
        rank1 = start("rank", "1", secret)
        procs.append(rank1)
        outputs = [proc.communicate(timeout=90)[0] for proc in procs]
        assert rank0.returncode == 0 and "sum 3" in outputs[0], outputs[0]
        assert rank1.returncode == 0 and "sum 3" in outputs[3], outputs[3]
        for stranger, output in zip(strangers, outputs[1:3], strict=True):
            assert stranger.returncode == 3 and "refused" in output, output
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_rank_with_another_secret_is_refused_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A misconfigured rank (another group's secret) never joins, never fails the group, and logs
    why instead of waiting silently for its startup timeout."""
    addr = f"ipc://{tmp_path}/rpc"
    leader = Leader(addr, 2)
    with caplog.at_level(logging.ERROR, logger="tessera.distributed.rpc"):
        link = rpc.WorkerLink(addr, 1, OTHER_KEYS)
        try:
            wait_until(lambda: "handshake with the leader" in caplog.text, 30, what="the rank's error")
            assert GROUP_SECRET_FILE_ENV in caplog.text
            assert leader.messages == [] and leader.failures == []
            assert leader.channel.rejected["handshake failed"] >= 1
        finally:
            link.close()
            leader.channel.close()
