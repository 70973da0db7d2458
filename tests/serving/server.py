"""Start a real `tessera serve` subprocess on a free loopback port, for the serving tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tessera.ports import free_port

API_KEY = "test-key-123"
MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = 240.0


REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_healthy(
    base_url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float, log: Path | None = None
) -> None:
    """Until ``base_url``/health answers 200; fails at once when one of ``procs`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                detail = log.read_text() if log is not None else ""
                raise RuntimeError(f"{proc.args} exited with {proc.returncode} during startup\n{detail}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not healthy after {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 20 s, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class ServerProcess:
    def __init__(
        self,
        model: Path | str,
        *extra_args: str,
        api_key: str | None = API_KEY,
        log: Path,
        module: str = "tessera.cli",  # a test module may wrap the CLI (e.g. to inject faults)
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [sys.executable, "-m", module, "serve", str(model), "--host", "127.0.0.1"]
        args += [
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL_NAME,
            "--num-threads",
            "1",
            *extra_args,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO_ROOT)]))
        env.pop("TESSERA_API_KEY", None)
        if api_key is not None:
            args += ["--api-key", api_key]
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        wait_healthy(self.base_url, [self.proc], STARTUP_TIMEOUT_S, self.log_path)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def engine_core_pid(self) -> int:
        """The spawned engine core: the server's child started by multiprocessing's spawn_main."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"spawn_main" in cmdline:
                return int(entry.name)
        raise LookupError("engine core process not found")

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    """The value of `name{...labels...}` in a Prometheus text exposition (labels: a substring)."""
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in "{ ") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return None
