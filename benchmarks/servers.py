"""Start an OpenAI-compatible server as a subprocess, wait until it is healthy, stop it after; what
CPU its processes and the load generator use meanwhile."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

STARTUP_TIMEOUT_S = 900


@contextmanager
def running_server(command: list[str], env: dict[str, str], base_url: str) -> Iterator[int]:
    """``command`` serving at ``base_url`` until the block ends, as the block's value its process
    group; its log tail in the error if it never comes up."""
    with tempfile.TemporaryFile() as log:
        # Its own process group: the engine processes it spawns are stopped with it.
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(
                        f"server did not start:\n{log.read().decode(errors='replace')[-3000:]}"
                    )
                try:
                    if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield server.pid
        finally:
            stop_group(server)


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process's group, SIGKILL to it if the leader has not exited within a minute."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # stragglers of a leader that exited are killed too
    process.wait()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of any of its threads, recursively)."""
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as children:
                for child in map(int, children.read().split()):
                    found += [child, *descendants(child)]
    return found


@contextmanager
def cpu_used(server_pid: int) -> Iterator[dict[str, float]]:
    """CPU seconds spent during the block, filled in when it ends: by the server's own process
    (``frontend``: the HTTP server), by the processes below it (``engine``) and by this one
    (``client``: the load generator). On a machine with few cores the three share them, so what
    the frontend and the client use is taken from the engine."""
    engine = descendants(server_pid)

    def engine_cpu() -> dict[int, float]:
        seconds = {}
        for pid in engine:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it exited meanwhile
                seconds[pid] = process_cpu_seconds(pid)
        return seconds

    used: dict[str, float] = {}
    frontend, engine_before, client = process_cpu_seconds(server_pid), engine_cpu(), time.process_time()
    yield used
    engine_after = engine_cpu()
    used["frontend"] = round(process_cpu_seconds(server_pid) - frontend, 2)
    used["engine"] = round(
        sum(engine_after[pid] - engine_before[pid] for pid in engine_after.keys() & engine_before.keys()), 2
    )
    used["client"] = round(time.process_time() - client, 2)
