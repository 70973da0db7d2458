"""Pod networking on one machine: a network namespace per pod on a bridge the node agent owns.

Layout of one agent's private range 10.B.0.0/16 (B picked free on this machine, never routed
anywhere: pods get no default route and the host does not forward):
  10.B.0.1        the bridge's own address: gateway, the cluster DNS server, and the pods' way
                  to the API server (port 443, the agent forwards it to the host's apiserver)
  10.B.N.1        node N's host address (its `hostIP`), also on the bridge
  10.B.N.2-254    pod addresses of node N
Every name this module creates starts with `tsr<id>`, so `sweep(id)` can remove all of it even
after the agent was killed. /etc/netns/<netns>/{hosts,resolv.conf} is how `ip netns exec`
gives each pod its own files (it bind-mounts them in a private mount namespace).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
CLUSTER_DOMAIN = "cluster.local"
# Second octets tried for a private range (10.255 is avoided: some hosts keep resolvers there).
FREE_RANGE_CANDIDATES = range(200, 250)
# Where pods reach the API server: the gateway's port of the `kubernetes` Service.
API_PORT = 443


def gateway_address(second_octet: int) -> str:
    return f"10.{second_octet}.0.1"


def every_gateway_address() -> list[str]:
    """Each address a gateway may get: the API server's certificate names them all, so pods
    verify it at whichever range their agent picked (after the certificate was made)."""
    return [gateway_address(b) for b in FREE_RANGE_CANDIDATES]


IP = shutil.which("ip") or "/usr/sbin/ip"  # pods' own PATH must not decide which `ip` runs


def ip(*args: str, check: bool = True) -> str:
    result = subprocess.run([IP, *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def name_prefix(agent_id: str) -> str:
    return f"tsr{agent_id}"


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    # Two agents starting at once must not pick the same range; flock on the temp directory
    # itself leaves no lock file behind.
    fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _second_octets_in_use() -> set[int]:
    used = set()
    for line in (ip("-o", "-4", "addr", "show") + ip("-4", "route", "show", "table", "all")).splitlines():
        for word in line.replace("/", " ").split():
            with contextlib.suppress(ValueError):
                address = ipaddress.IPv4Address(word)
                if address.packed[0] == 10:
                    used.add(address.packed[1])
    return used


@dataclass
class PodSandbox:
    netns: str
    host_link: str
    address: str
    hostname: str


class PodNetwork:
    """The bridge and per-node host addresses; `create_sandbox` gives one pod its namespace."""

    def __init__(self, agent_id: str, node_count: int) -> None:
        self.agent_id = agent_id
        self.prefix = name_prefix(agent_id)
        self.bridge = self.prefix
        self.node_count = node_count
        self.second_octet = 0
        self._free: dict[int, list[int]] = {}
        self._serial = 0

    @property
    def gateway(self) -> str:
        return gateway_address(self.second_octet)

    def host_ip(self, node_index: int) -> str:
        return f"10.{self.second_octet}.{node_index + 1}.1"

    def create(self) -> None:
        with _machine_lock():
            used = _second_octets_in_use()
            self.second_octet = next(b for b in FREE_RANGE_CANDIDATES if b not in used)
            # A fixed address: a bridge left to itself takes the lowest MAC among its ports, so
            # each pod's veth joining or leaving can change the gateway's MAC under the other
            # pods' ARP entries, and their packets to the host vanish for tens of seconds.
            ip("link", "add", self.bridge, "address", bridge_mac(self.agent_id), "type", "bridge")
            for address in [self.gateway, *(self.host_ip(n) for n in range(self.node_count))]:
                ip("addr", "add", f"{address}/16", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        self._free = {n: list(range(2, 255)) for n in range(self.node_count)}

    def create_sandbox(
        self,
        node_index: int,
        pod_name: str,
        namespace: str,
        hostname: str,
        fqdn: str | None,
        aliases: Sequence[tuple[str, str]],
    ) -> PodSandbox:
        self._serial += 1
        netns = f"{self.prefix}-{self._serial}-{pod_name}"[:60]
        host_link = f"{self.prefix}{self._serial:x}"
        address = f"10.{self.second_octet}.{node_index + 1}.{self._free[node_index].pop(0)}"
        sandbox = PodSandbox(netns=netns, host_link=host_link, address=address, hostname=hostname)
        try:
            ip("netns", "add", netns)
            ip("-n", netns, "link", "set", "lo", "up")
            ip("link", "add", host_link, "type", "veth", "peer", "name", "eth0", "netns", netns)
            ip("link", "set", host_link, "master", self.bridge, "up")
            ip("-n", netns, "addr", "add", f"{address}/16", "dev", "eth0")
            ip("-n", netns, "link", "set", "eth0", "up")
            etc = NETNS_ETC / netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file(address, hostname, fqdn, aliases))
            (etc / "resolv.conf").write_text(resolv_conf(self.gateway, namespace))
        except BaseException:
            self.remove_sandbox(sandbox)
            raise
        return sandbox

    def remove_sandbox(self, sandbox: PodSandbox) -> None:
        kill_netns_processes(sandbox.netns)
        ip("netns", "del", sandbox.netns, check=False)  # takes the veth pair with it
        ip("link", "del", sandbox.host_link, check=False)
        _remove_netns_etc(sandbox.netns)
        octets = sandbox.address.split(".")
        self._free.setdefault(int(octets[2]) - 1, []).append(int(octets[3]))

    def destroy(self) -> None:
        sweep(self.agent_id)


def bridge_mac(agent_id: str) -> str:
    """A locally administered unicast MAC of this agent's own (02:... never belongs to hardware)."""
    digest = hashlib.sha256(agent_id.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, 0x54, *digest[:4]))


def resolv_conf(nameserver: str, namespace: str) -> str:
    search = f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
    return f"nameserver {nameserver}\nsearch {search}\noptions ndots:5\n"


def hosts_file(address: str, hostname: str, fqdn: str | None, aliases: Sequence[tuple[str, str]]) -> str:
    """The kubelet's managed /etc/hosts: localhost, the pod's own names, then spec.hostAliases."""
    own = f"{address}\t{fqdn}\t{hostname}" if fqdn else f"{address}\t{hostname}"
    lines = [
        "# Kubernetes-managed hosts file.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "fe00::0\tip6-localnet",
        "fe00::0\tip6-mcastprefix",
        "fe00::1\tip6-allnodes",
        "fe00::2\tip6-allrouters",
        own,
        *(f"{alias_ip}\t{names}" for alias_ip, names in aliases),
    ]
    return "\n".join(lines) + "\n"


def netns_pids(netns: str) -> list[int]:
    return [int(pid) for pid in ip("netns", "pids", netns, check=False).split()]


def kill_netns_processes(netns: str) -> None:
    for pid in netns_pids(netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _remove_netns_etc(netns: str) -> None:
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only when no other namespace keeps files there


def _agent_netns(prefix: str) -> list[str]:
    return [
        line.split()[0]
        for line in ip("netns", "list", check=False).splitlines()
        if line.startswith(f"{prefix}-")
    ]


def _agent_links(prefix: str) -> list[str]:
    # `ip -o link` lines look like "7: tsrab12cd3@if2: <BROADCAST,...> ..."
    names = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").splitlines()]
    return [name for name in names if name.startswith(prefix)]


def sweep(agent_id: str) -> None:
    """Removes every process, namespace, link and /etc/netns entry of this agent (idempotent)."""
    prefix = name_prefix(agent_id)
    for netns in _agent_netns(prefix):
        kill_netns_processes(netns)
        ip("netns", "del", netns, check=False)
        _remove_netns_etc(netns)
    for link in _agent_links(prefix):
        ip("link", "del", link, check=False)
    if NETNS_ETC.is_dir():
        for leftover in NETNS_ETC.glob(f"{prefix}-*"):
            _remove_netns_etc(leftover.name)


def agent_leftovers(agent_id: str) -> list[str]:
    """Everything of this agent still on the machine: namespaces, links, their mounts and files."""
    prefix = name_prefix(agent_id)
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if prefix in line]
    files = [str(path) for path in NETNS_ETC.glob(f"{prefix}-*")] if NETNS_ETC.is_dir() else []
    return _agent_netns(prefix) + _agent_links(prefix) + mounts + files
