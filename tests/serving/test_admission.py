"""Admission: work the engine could never schedule is refused, and the waiting room counts sequences.

Own server: chunked prefill off with a 64-token step (so a longer prompt can never be
scheduled), one running sequence at most, and room for two waiting sequences.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.serving.checks import assert_openai_error, assert_still_serving
from tests.serving.server import MODEL_NAME, ServerProcess, metric_value

STEP_TOKENS = 64


@pytest.fixture(scope="module")
def strict_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("strict-server") / "server.log"
    args = ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(STEP_TOKENS)]
    args += ["--max-num-seqs", "1", "--max-waiting-requests", "2"]
    proc = ServerProcess(tiny_llama_dir, *args, api_key=None, log=log)
    yield proc
    proc.stop()


def complete(server: ServerProcess, body: dict[str, Any], timeout: float = 20) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 2, **body}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=timeout)


def test_prompt_longer_than_one_step_is_400_without_chunked_prefill(strict_server: ServerProcess) -> None:
    error = assert_openai_error(complete(strict_server, {"prompt": [7] * (STEP_TOKENS + 1)}), 400)
    assert error["param"] == "prompt"
    assert "max_num_batched_tokens" in error["message"]
    assert complete(strict_server, {"prompt": [7] * STEP_TOKENS}).status_code == 200
    assert_still_serving(strict_server)


def test_waiting_room_counts_sequences_not_requests(strict_server: ServerProcess) -> None:
    client = openai.OpenAI(
        base_url=f"{strict_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    )

    def long_stream(prompt: str) -> Any:
        return client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
        )

    running = long_stream("first")
    next(iter(running))  # it has a token: it holds the only running slot
    waiting = long_stream("second")  # admitted (nobody waits yet); it waits for the slot
    deadline = time.monotonic() + 30
    while (
        metric_value(httpx.get(f"{strict_server.base_url}/metrics").text, "tessera:num_requests_waiting") != 1
    ):
        assert time.monotonic() < deadline, "the second request never showed up as waiting"
        time.sleep(0.1)
    try:
        # One request, but two sequences: with one already waiting that is three, over the room of two.
        for body in ({"prompt": ["a", "b"]}, {"prompt": "a", "n": 2}):
            response = complete(strict_server, body)
            error = assert_openai_error(response, 503)
            assert "sequences" in error["message"]
            assert int(response.headers["retry-after"]) >= 1
    finally:
        running.close()
        waiting.close()
    assert_still_serving(strict_server)
