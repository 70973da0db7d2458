"""Overload answers 503 + Retry-After; a killed engine core fails its callers fast and stops the server.

Own server: one running sequence at most (--max-num-seqs 1) and no waiting room
(--max-waiting-requests 0), and this module kills its engine core at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.serving.server import MODEL_NAME, ServerProcess, metric_value


@pytest.fixture(scope="module")
def small_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("small-server") / "server.log"
    args = ["--max-model-len", "512", "--max-num-seqs", "1", "--max-waiting-requests", "0"]
    with pytest.MonkeyPatch.context() as env:  # a frozen core is noticed in seconds, never killed
        env.setenv("TESSERA_ENGINE_HEARTBEAT_TIMEOUT_S", "4")
        env.setenv("TESSERA_ENGINE_FATAL_SILENCE_S", "600")
        proc = ServerProcess(tiny_llama_dir, *args, api_key=None, log=log)
    yield proc
    proc.stop()


def long_stream(client: openai.OpenAI, prompt: str, n: int = 1) -> openai.Stream:  # type: ignore[type-arg]
    return client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=400, n=n, stream=True, extra_body={"ignore_eos": True}
    )


def test_waiting_queue_over_limit_is_503_with_retry_after(small_server: ServerProcess) -> None:
    client = openai.OpenAI(
        base_url=f"{small_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    )
    running = long_stream(client, "first")
    next(iter(running))  # it has a token: it is running (the only slot)
    waiting = long_stream(client, "second")  # admitted (nobody waits yet); it waits for the slot
    response = httpx.post(
        f"{small_server.base_url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "third", "max_tokens": 2},
    )
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == 503
    running.close()
    waiting.close()


def test_non_streaming_client_that_gives_up_is_aborted(small_server: ServerProcess) -> None:
    def finished(reason: str) -> float:
        text = httpx.get(f"{small_server.base_url}/metrics").text
        return metric_value(text, "tessera:request_success_total", reason) or 0

    aborted_before, length_before = finished("abort"), finished("length")
    # 16 samples of 400 tokens, one sequence at a time: far longer than the client waits.
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400, "n": 16, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small_server.base_url}/v1/completions", json=body, timeout=0.5)

    def settled() -> tuple[float, float]:
        return finished("abort") - aborted_before, finished("length") - length_before

    deadline = time.monotonic() + 30
    while sum(settled()) != 16 and time.monotonic() < deadline:
        time.sleep(0.1)
    aborted, completed = settled()
    # On a fast machine the first sample may finish before the client gives up; every other
    # sample must be aborted, not left running.
    assert aborted + completed == 16
    assert aborted >= 14


def wait_until_idle(server: ServerProcess) -> None:
    """Earlier streams were closed: wait until their aborts freed the slot."""
    deadline = time.monotonic() + 30
    while metric_value(httpx.get(f"{server.base_url}/metrics").text, "tessera:num_requests_running") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_frozen_engine_core_turns_new_requests_away_until_it_answers(small_server: ServerProcess) -> None:
    """Alive but not answering (stopped, swapped out): new work gets a 503 naming why, not a hang."""
    wait_until_idle(small_server)
    core = small_server.engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{small_server.base_url}/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert health.status_code == 503 and "not answered" in health.json()["error"]["message"]
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
        refused = httpx.post(f"{small_server.base_url}/v1/completions", json=body, timeout=10)
        assert refused.status_code == 503 and "not answered" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
    finally:
        os.kill(core, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while httpx.get(f"{small_server.base_url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    answered = httpx.post(f"{small_server.base_url}/v1/completions", json=body, timeout=60)
    assert answered.status_code == 200


def waiting_sequences(server: ServerProcess) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return metric_value(text, "tessera:num_requests_waiting") or 0.0


def test_sigterm_answers_what_is_still_open_with_a_503_and_exits_cleanly(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """After its grace period a stopping server ends each open request in OpenAI's error format
    (a stream with an error event), never with uvicorn's plain-text 500 or a cut connection."""
    args = ["--max-model-len", "512", "--max-num-seqs", "1"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESSERA_SHUTDOWN_GRACE_S", "1")
        server = ServerProcess(tiny_llama_dir, *args, api_key=None, log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        # 16 samples of 400 tokens, one sequence at a time: far longer than the test runs.
        chunks = iter(long_stream(client, "Once upon a time", n=16))
        next(chunks)
        outcome: dict[str, Any] = {}

        def waiting_request() -> None:  # waits for the only slot, so it is still open at SIGTERM
            body = {"model": MODEL_NAME, "prompt": "second", "max_tokens": 400, "n": 16, "ignore_eos": True}
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            outcome["status"], outcome["body"] = response.status_code, response.json()

        waiter = threading.Thread(target=waiting_request)
        waiter.start()
        # Its 16 samples wait behind what is left of the first request's 15 (one sequence runs at a
        # time, and a sample of the first may finish meanwhile): more than 15 waiting means it queued.
        deadline = time.monotonic() + 30
        while waiting_sequences(server) <= 15 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting_sequences(server) > 15, "the second request never queued"
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        waiter.join(timeout=30)
        assert outcome["status"] == 503 and "shutting down" in outcome["body"]["error"]["message"]
        # uvicorn re-raises the SIGTERM it deferred once it has shut down: the usual way to stop.
        assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Traceback" not in (tmp_path / "server.log").read_text()
    finally:
        server.stop()


def test_killed_engine_core_fails_the_caller_and_exits_the_server(small_server: ServerProcess) -> None:
    client = openai.OpenAI(
        base_url=f"{small_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    )
    wait_until_idle(small_server)
    stream = long_stream(client, "Once upon a time")
    chunks = iter(stream)
    next(chunks)
    os.kill(small_server.engine_core_pid(), signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    assert time.monotonic() - killed_at < 10
    # The server reports itself unhealthy (if still up), then exits non-zero for its supervisor.
    with contextlib.suppress(httpx.TransportError):  # already gone is fine too
        assert httpx.get(f"{small_server.base_url}/health", timeout=2).status_code == 503
    assert small_server.proc.wait(timeout=30) != 0


def test_a_server_whose_start_fails_after_the_engine_core_started_exits(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The engine core loads the model, then the frontend fails (here, on a broken
    generation_config.json): the server must exit non-zero, not wait for its engine core process
    forever (a pod that stays Running instead of restarting)."""
    broken = tmp_path / "broken-generation-config"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "generation_config.json").write_text("{not json")
    command = [
        sys.executable,
        "-m",
        "tessera.cli",
        "serve",
        str(broken),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    done = subprocess.run(
        command, capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode != 0
    assert b"JSONDecodeError" in done.stderr + done.stdout
