"""Start a real `tessera router` subprocess on a free loopback port, for the router tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tessera.ports import free_port
from tests.serving.server import REPO_ROOT, stop_process, wait_healthy

STARTUP_TIMEOUT_S = 60.0


class RouterProcess:
    def __init__(self, endpoints_file: Path, *extra_args: str, log: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "tessera.cli",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        args += [
            "--endpoints-file",
            str(endpoints_file),
            "--reload-interval",
            "0.2",
            "--poll-interval",
            "0.2",
        ]
        args += list(extra_args)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO_ROOT)]))
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self.base_url, [self.proc], STARTUP_TIMEOUT_S, log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()
