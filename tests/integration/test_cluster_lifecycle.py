"""`make demo` / `make demo-down`'s cluster lifecycle (e2e.local_cluster up / down): a start that is
interrupted or stopped half-way leaves nothing running, and a stale record harms nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e import local_cluster

pytestmark = pytest.mark.k8s
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of its own (the record lives there), with the cached Kubernetes binaries."""
    bin_dir = local_cluster.default_bin_dir()
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    mine = local_cluster.default_bin_dir()
    mine.parent.mkdir(parents=True)
    mine.symlink_to(bin_dir)
    return tmp_path / "cache"


def supervisors(cache: Path) -> list[int]:
    """Cluster supervisors started with this cache (their environment names it)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--foreground" in argv and f"TESSERA_CACHE={cache}".encode() in environ:
            found.append(int(proc.name))
    return found


def test_a_start_interrupted_by_ctrl_c_stops_its_cluster(own_cache: Path) -> None:
    # A terminal's Ctrl-C: SIGINT to `up` while the supervisor it started is still starting.
    script = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    script += "from e2e.local_cluster import _cli; sys.exit(_cli(['up', '--nodes', '0']))"
    up = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not supervisors(own_cache) and time.monotonic() < deadline:
        time.sleep(0.1)
    started = supervisors(own_cache)
    assert started, "no supervisor started"
    up.send_signal(signal.SIGINT)
    out, _ = up.communicate(timeout=120)
    assert up.returncode == 130 and "stopping the cluster that was starting" in out
    # A process the supervisor forked shows the supervisor's command line until it execs (or dies
    # with its parent): on a loaded machine that can outlast `down` by a moment.
    deadline = time.monotonic() + 10
    while supervisors(own_cache) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not supervisors(own_cache) and not local_cluster.pointer_file().exists()
    assert local_cluster.down() == 0  # nothing left to stop


def test_a_stale_record_is_dropped_and_its_pid_left_alone(own_cache: Path) -> None:
    # The record outlived its supervisor (a reboot, an OOM kill): its pid is now someone else's.
    unrelated = subprocess.Popen(["sleep", "60"])
    try:
        local_cluster.pointer_file().write_text(f'{{"pid": {unrelated.pid}, "state": "/tmp/gone"}}')
        assert local_cluster.recorded_cluster() is None
        local_cluster.pointer_file().write_text(f'{{"pid": {unrelated.pid}, "state": "/tmp/gone"}}')
        assert local_cluster.down() == 0
        assert unrelated.poll() is None and not local_cluster.pointer_file().exists()
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_service_exposed_on_a_port_another_program_holds_fails_the_start(own_cache: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int((holder.stdout.readline() if holder.stdout else "").split("port ")[1].split()[0])
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "e2e.local_cluster",
                "up",
                "--foreground",
                "--nodes",
                "0",
                "--expose",
                f"default/svc:80={port}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode != 0 and "address already in use" in done.stderr
        assert not supervisors(own_cache)
    finally:
        holder.kill()
        holder.wait()
