"""A request that fails in output processing fails alone: a 500 (or an error event) for it, others complete.

Own server, started through tests.serving.faulty_frontend: a request whose stop strings hold
FAIL_MARKER makes its detokenizer raise, as a bug would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.serving.checks import assert_openai_error, assert_still_serving
from tests.serving.faulty_frontend import FAIL_MARKER, SECRET_DETAIL
from tests.serving.server import MODEL_NAME, ServerProcess, metric_value


@pytest.fixture(scope="module")
def faulty_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("faulty-server") / "server.log"
    proc = ServerProcess(
        tiny_llama_dir,
        "--max-model-len",
        "256",
        api_key=None,
        log=log,
        module="tests.serving.faulty_frontend",
    )
    yield proc
    proc.stop()


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_only_the_failing_request_fails(faulty_server: ServerProcess) -> None:
    client = client_of(faulty_server)

    def healthy(index: int) -> str:
        completion = client.completions.create(
            model=MODEL_NAME,
            prompt=f"Once upon a time {index}",
            max_tokens=40,
            extra_body={"ignore_eos": True},
        )
        assert completion.choices[0].finish_reason == "length"
        return completion.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(healthy, i) for i in range(4)]
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(
                model=MODEL_NAME, prompt="Once upon a time", max_tokens=40, stop=[FAIL_MARKER]
            )
        assert all(future.result() for future in others)
    error = info.value.body
    assert isinstance(error, dict) and error["type"] == "server_error" and error["code"] == 500
    assert SECRET_DETAIL not in json.dumps(error)
    assert_still_serving(faulty_server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_failing_stream_ends_with_an_error_event_then_done(faulty_server: ServerProcess, path: str) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 10, "stream": True, "stop": [FAIL_MARKER]}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    with httpx.stream("POST", f"{faulty_server.base_url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and SECRET_DETAIL not in error["message"]
    assert_still_serving(faulty_server)


def test_every_sample_of_a_failed_request_is_counted_as_failed(faulty_server: ServerProcess) -> None:
    def failed() -> float:
        text = httpx.get(f"{faulty_server.base_url}/metrics").text
        return metric_value(text, "tessera:request_success_total", 'finished_reason="error"') or 0

    before = failed()
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 200, "n": 3, "stop": [FAIL_MARKER]}
    assert_openai_error(httpx.post(f"{faulty_server.base_url}/v1/completions", json=body, timeout=60), 500)
    assert failed() - before == 3
    assert_still_serving(faulty_server)
