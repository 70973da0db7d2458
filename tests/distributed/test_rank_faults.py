"""A rank that dies or hangs fails the engine promptly: the client gets an error within 10 s,
/health fails, and every rank process exits non-zero within 30 s. Nothing hangs."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.distributed.rank_processes import children_of, cmdline
from tests.serving.server import ServerProcess

CLIENT_ERROR_WITHIN_S = 10.0
ALL_EXIT_WITHIN_S = 30.0


def rank_pids(server: ServerProcess) -> list[int]:
    """The `tessera worker` processes the engine core started, in rank order."""
    ranks = {}
    for pid in children_of(server.engine_core_pid()):
        line = cmdline(pid)
        if b"worker" in line:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(v.split(b"=")[1]) for v in environ if v.startswith(b"TESSERA_RANK="))
            ranks[rank] = pid
    return [ranks[r] for r in sorted(ranks)]


def exited(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "victim"), [(signal.SIGKILL, 1), (signal.SIGSTOP, 3)], ids=["kill", "stop"]
)
def test_a_failed_rank_fails_requests_fast_and_takes_every_rank_down(
    tiny_llama_dir: Path, tmp_path: Path, fault: signal.Signals, victim: int
) -> None:
    server = ServerProcess(
        tiny_llama_dir,
        "--tp",
        "2",
        "--pp",
        "2",
        "--max-model-len",
        "1024",
        api_key=None,
        log=tmp_path / "s.log",
    )
    try:
        ranks = rank_pids(server)
        engine_core = server.engine_core_pid()
        assert len(ranks) == 4
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=1000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)  # the request is running on every rank
        hit = time.monotonic()
        os.kill(ranks[victim], fault)
        failed_at: list[float] = []

        def drain() -> None:
            try:
                for _ in chunks:
                    pass
            except (openai.APIError, httpx.HTTPError):
                pass
            failed_at.append(time.monotonic())

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        reader.join(CLIENT_ERROR_WITHIN_S)
        assert failed_at, f"the client still waits {CLIENT_ERROR_WITHIN_S:.0f} s after the fault"
        assert failed_at[0] - hit < CLIENT_ERROR_WITHIN_S
        health = httpx.get(f"{server.base_url}/health", timeout=5) if server.proc.poll() is None else None
        assert health is None or health.status_code != 200

        deadline = hit + ALL_EXIT_WITHIN_S
        while time.monotonic() < deadline and not all(exited(p) for p in [*ranks, engine_core]):
            time.sleep(0.2)
        assert all(exited(p) for p in [*ranks, engine_core]), "a rank outlived its failed engine"
        server.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert server.proc.returncode != 0
    finally:
        server.stop()


@pytest.mark.slow
def test_a_killed_engine_core_leaves_no_rank_and_no_ipc_folder(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """SIGKILL (the OOM killer's) of a multi-rank engine core: its ranks go with it, the server
    exits non-zero, and neither the core's nor its ranks' socket folders stay behind."""
    patterns = [os.path.join(tempfile.gettempdir(), f"tessera-{kind}-*") for kind in ("core", "ranks")]
    before = {p: set(glob.glob(p)) for p in patterns}
    server = ServerProcess(tiny_llama_dir, "--pp", "2", api_key=None, log=tmp_path / "s.log")
    try:
        ranks = rank_pids(server)
        assert len(ranks) == 2
        os.kill(server.engine_core_pid(), signal.SIGKILL)
        assert server.proc.wait(timeout=ALL_EXIT_WITHIN_S) != 0
        deadline = time.monotonic() + ALL_EXIT_WITHIN_S
        while time.monotonic() < deadline and not all(exited(p) for p in ranks):
            time.sleep(0.2)
        assert all(exited(p) for p in ranks), "a rank outlived its engine core"
    finally:
        server.stop()
    assert {p: set(glob.glob(p)) for p in patterns} == before


@pytest.mark.slow
def test_a_first_stage_slower_than_the_collective_limit_is_waited_for(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 1 waits through stage 0's whole share of a step: a stage 0 that takes longer than a
    collective may (stopped for 3 s against a 1 s limit) is slow, not dead, and its step completes."""
    monkeypatch.setenv("TESSERA_COLLECTIVE_TIMEOUT", "1")
    server = ServerProcess(
        tiny_llama_dir, "--pp", "2", "--max-model-len", "256", api_key=None, log=tmp_path / "s.log"
    )
    try:
        ranks = rank_pids(server)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        os.kill(ranks[0], signal.SIGSTOP)  # the first stage, while stage 1 waits for the step's input
        resume = threading.Timer(3.0, os.kill, (ranks[0], signal.SIGCONT))
        resume.start()
        try:
            started = time.monotonic()
            answer = client.completions.create(
                model="tiny", prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True}
            )
            assert time.monotonic() - started >= 2.5  # it did wait for the stopped stage
        finally:
            resume.join()
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        assert not any(exited(pid) for pid in ranks)
    finally:
        server.stop()
