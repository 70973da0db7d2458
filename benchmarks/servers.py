"""Start an OpenAI-compatible server as a subprocess, wait until it is healthy, stop it after."""

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
