"""/health of a live `tessera serve` follows its engine core: 503 while the core does not answer
(frozen with SIGSTOP here; a hung rank or a deadlock look the same), 200 again once it does."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving.server import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("health-server") / "server.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESSERA_ENGINE_HEARTBEAT_TIMEOUT_S", "3")
        proc = ServerProcess(tiny_llama_dir, "--max-model-len", "128", api_key=None, log=log)
    yield proc
    proc.stop()


def wait_for_health(server: ServerProcess, status: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{server.base_url}/health", timeout=5).status_code == status:
            return
        time.sleep(0.3)
    raise AssertionError(f"/health did not turn {status} within {timeout} s")


def test_health_fails_while_the_engine_core_does_not_answer(server: ServerProcess) -> None:
    wait_for_health(server, 200)
    core = server.engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        wait_for_health(server, 503)
    finally:
        os.kill(core, signal.SIGCONT)
    wait_for_health(server, 200)
    assert server.proc.poll() is None  # unhealthy is for the supervisor to judge; the server stays up
