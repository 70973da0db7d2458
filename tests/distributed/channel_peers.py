"""Peers of the rank channel over real sockets: a rank's DEALER as WorkerLink connects it (with
the group's keys), or a stranger's (another secret, no CURVE at all, any identity)."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from tessera.distributed.group_secret import GroupKeys

KEYS = GroupKeys(b"the group's secret for these tests")
OTHER_KEYS = GroupKeys(b"a stranger's guess at the secret!")


def rank_peer(
    context: zmq.Context, addr: str, rank: int, keys: GroupKeys | None = KEYS, identity: bytes | None = None
) -> zmq.Socket:
    """Rank ``rank``'s end of the channel, as WorkerLink connects it (``keys`` None: no CURVE)."""
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, identity if identity is not None else f"rank-{rank}".encode())
    peer.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        public_key, secret_key = keys.rank(rank)
        peer.setsockopt(zmq.CURVE_SERVERKEY, keys.server[0])
        peer.setsockopt(zmq.CURVE_PUBLICKEY, public_key)
        peer.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
    peer.connect(addr)
    return peer


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s"
        time.sleep(0.02)
