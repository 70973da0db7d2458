"""Run a replica group's pods as plain processes on loopback, exactly as the operator builds them.

Each pod's command, arguments and environment come from the operator's own pod builder; only
what a pod network would provide differs: the leader's address is 127.0.0.1 and every port is
a free loopback port (several groups share this machine), the pod's writable paths (cache,
/tmp) stay this machine's, and the group's secret, which the operator mounts from a Secret, is a
file of random bytes in the test's folder.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tessera.ports import free_port
from tessera.topology import GROUP_SECRET_FILE_ENV
from tessera_operator import builders
from tessera_operator.api import InferenceClusterSpec

# The pod's volumes (emptyDirs at /cache and /tmp) do not exist on the host.
HOST_PATH_ENV = ("TESSERA_CACHE", "TMPDIR", "HOME")


def rank_pod_processes(
    spec: InferenceClusterSpec, log_dir: Path, last_pod_delay_s: float = 0.0
) -> tuple[list[subprocess.Popen[bytes]], int]:
    """Start group 0's pods (leader first; the last one `last_pod_delay_s` after the leader's own
    rank began to join, as a pod still pulling its image would); returns the processes and the
    leader's HTTP port."""
    pods = group_pods(spec)
    loopback = loopback_env(log_dir)
    procs = []
    for pod in pods:
        if last_pod_delay_s and pod is pods[-1]:
            wait_for_line(log_dir / f"{pods[0]['metadata']['name']}.log", b"rank 0 of", 120)
            time.sleep(last_pod_delay_s)
        procs.append(pod_process(pod, loopback, log_dir))
    return procs, int(loopback["TESSERA_API_PORT"])


def group_pods(spec: InferenceClusterSpec) -> list[dict[str, Any]]:
    """Group 0's pods as the operator builds them, leader first."""
    ref = builders.ClusterRef("demo", "ns", "uid-1")
    return builders.build_group(ref, spec, builders.revision_of(spec), 0)


def loopback_env(log_dir: Path) -> dict[str, str]:
    """What a pod network provides, on loopback: the leader's address, free ports, the group secret."""
    ports = {
        "TESSERA_DIST_PORT": free_port(),
        "TESSERA_RPC_PORT": free_port(),
        "TESSERA_API_PORT": free_port(),
    }
    return {
        "TESSERA_LEADER_ADDR": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(ports["TESSERA_DIST_PORT"]),
        "GLOO_SOCKET_IFNAME": "lo",
        **{name: str(port) for name, port in ports.items()},
        GROUP_SECRET_FILE_ENV: group_secret_file(log_dir),
    }


def pod_process(pod: dict[str, Any], loopback: dict[str, str], log_dir: Path) -> subprocess.Popen[bytes]:
    """The pod's container command and environment as a process (its log: `<pod name>.log`)."""
    container = pod["spec"]["containers"][0]
    env = {var["name"]: var["value"] for var in container["env"] if "value" in var}
    for name in HOST_PATH_ENV:
        env.pop(name, None)
    env = {**os.environ, **env, **loopback, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TESSERA_API_KEY", None)
    api_port = loopback["TESSERA_API_PORT"]
    args = [api_port if a == str(builders.DEFAULT_API_PORT) else a for a in container["args"]]
    args = ["127.0.0.1" if a == "0.0.0.0" else str(a) for a in args]
    assert container["command"][0] == "tessera"
    command = [sys.executable, "-m", "tessera.cli", *container["command"][1:], *args]
    log = (log_dir / f"{pod['metadata']['name']}.log").open("wb")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def group_secret_file(folder: Path) -> str:
    """A group secret as the operator's Secret volume holds it (32 random bytes, read-only)."""
    path = folder / "group-secret"
    path.write_bytes(secrets.token_bytes(32))
    path.chmod(0o400)
    return str(path)


def wait_for_line(log: Path, text: bytes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_bytes():
        assert time.monotonic() < deadline, f"{log.name} has no {text!r} after {timeout_s:.0f} s"
        time.sleep(0.2)


def children_of(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            children.append(int(entry.name))
    return children


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_all_exit(procs: list[Any], timeout_s: float) -> dict[int, int | None]:
    """Exit status of each Popen after at most ``timeout_s`` (None: still running)."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    return {proc.pid: proc.poll() for proc in procs}


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
