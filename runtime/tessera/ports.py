"""A free loopback TCP port for a listener that will bind it later, chosen below the kernel's
ephemeral range.

A port found by binding port 0 comes from the ephemeral range (``ip_local_port_range``), the
range the kernel also takes the local ports of outgoing connections from. Between choosing such
a port and binding it (a server's start-up: seconds), a connection may be given it, such as
gloo's between ranks or a client's, and the bind fails with EADDRINUSE: a test's `tessera serve`
with TP 2 x PP 2 once failed so. The kernel never hands out a port below that range on its
own, so there only another listener that picks the same port can collide: the pick is random.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_START = 32768  # the kernel's default lower bound
LOWEST_PORT = 10000  # above the well-known ports and most registered services
ATTEMPTS = 100


def ephemeral_range_start(path: Path = LOCAL_PORT_RANGE) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_EPHEMERAL_START


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on or connects from now, below the ephemeral
    range where that range leaves room; from the kernel (port 0) where it does not."""
    highest = ephemeral_range_start() - 1
    if highest - LOWEST_PORT >= ATTEMPTS:
        for _ in range(ATTEMPTS):
            port = random.randint(LOWEST_PORT, highest)
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
