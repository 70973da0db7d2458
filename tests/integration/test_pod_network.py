"""The node agent's pod network on its own: a pod keeps reaching the host while other pods come and go."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator

import pytest

from e2e import podnet

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="pod networks need root and iproute2"
)

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()"


@pytest.fixture
def network() -> Iterator[podnet.PodNetwork]:
    net = podnet.PodNetwork(uuid.uuid4().hex[:6], node_count=1)
    net.create()
    try:
        yield net
    finally:
        net.destroy()


def connects_to_host(sandbox: podnet.PodSandbox, host: str, port: int) -> bool:
    """Whether a process in the pod opens a TCP connection to the host within 3 s."""
    command = [podnet.IP, "netns", "exec", sandbox.netns, sys.executable, "-c", CONNECT, host, str(port)]
    return subprocess.run(command, capture_output=True, timeout=30).returncode == 0


def test_a_pod_reaches_the_host_right_after_another_pod_leaves(network: podnet.PodNetwork) -> None:
    listener = socket.create_server((network.gateway, 0))
    port = listener.getsockname()[1]
    threading.Thread(target=lambda: [listener.accept()[0].close() for _ in range(2)], daemon=True).start()
    first = network.create_sandbox(0, "first", "ns", "first", None, [])
    # The leaving pod's link has the lowest MAC on the bridge: a bridge that takes the lowest port
    # MAC as its own answers the first pod's ARP with it, and loses it when that pod goes.
    leaving = network.create_sandbox(0, "leaving", "ns", "leaving", None, [])
    podnet.ip("link", "set", leaving.host_link, "address", "02:00:00:00:00:01")
    assert connects_to_host(first, network.gateway, port)  # the first pod caches the gateway's MAC
    network.remove_sandbox(leaving)
    assert connects_to_host(first, network.gateway, port)  # within 3 s, not once its ARP entry ages
    listener.close()
