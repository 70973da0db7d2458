"""Requests built to kill, wedge or overrun the server get a 4xx, and the server goes on serving.

Each case was seen against an unhardened server (a dead engine core, a 500 in a non-OpenAI
body, a 200 with no choices, work admitted that never finishes); after each one the server
must still answer /health and a normal request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.serving.checks import assert_openai_error, assert_still_serving
from tests.serving.server import MODEL_NAME, ServerProcess

VOCAB_SIZE = 512  # the tiny model's
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def post(server: ServerProcess, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}{path}",
        json={"model": MODEL_NAME, **body},
        headers=server.headers,
        timeout=timeout,
    )


def post_raw(server: ServerProcess, path: str, content: bytes, **headers: str) -> httpx.Response:
    headers = {**server.headers, "content-type": "application/json", **headers}
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [2**31 - 1]}, "stop_token_ids"),
        (COMPLETIONS, {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
        (CHAT, {"messages": MESSAGES, "min_tokens": 2, "stop_token_ids": [5, 10**6]}, "stop_token_ids"),
        (COMPLETIONS, {"prompt": [1, 2, VOCAB_SIZE]}, "prompt"),
        (COMPLETIONS, {"prompt": [[1, 2], [3, 2**31 - 1]]}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"99999999": 5}}, "logit_bias"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {"-1": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "hi", "allowed_token_ids": [1, VOCAB_SIZE]}, "allowed_token_ids"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs"),
        (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_400(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    error = assert_openai_error(post(server, path, body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param)
    assert_still_serving(server)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        (COMPLETIONS, '{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt"),
        (COMPLETIONS, '{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}', "stop"),
        (COMPLETIONS, '{"model": "a\\ud800", "prompt": "hi"}', "model"),
        (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud83d"}]}', "messages"),
        (
            CHAT,
            '{"model": "tiny", "messages": [{"role": "user", "content": "x", "name": "\\udc00"}]}',
            "messages",
        ),
    ],
)
def test_lone_surrogates_are_400(server: ServerProcess, path: str, body: str, param: str) -> None:
    error = assert_openai_error(post_raw(server, path, body.encode()), 400)
    assert error["param"].startswith(param)
    assert_still_serving(server)


def test_empty_prompt_list_is_400(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[], max_tokens=2)
    assert "prompt" in info.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["hi"] * 300, "n": 128}, "prompt"),  # 38,400 sequences
        ({"prompt": ["hi"] * 100, "n": 4}, "n"),  # 400 sequences, over the default 256
        ({"prompt": "hi", "n": 129}, "n"),
        ({"prompt": "hi", "stop": [f"s{i}" for i in range(100_000)]}, "stop"),
        ({"prompt": "hi", "stop": ["x" * 513]}, "stop"),
        ({"prompt": "hi", "stop_token_ids": list(range(2)) * 600}, "stop_token_ids"),
        # No max_tokens: the room the prompt leaves of the 128-token context, below min_tokens.
        ({"prompt": "hi", "max_tokens": None, "min_tokens": 200}, "min_tokens"),
    ],
)
def test_requests_over_the_caps_are_400(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    error = assert_openai_error(post(server, COMPLETIONS, body), 400)
    assert error["param"] == param
    assert_still_serving(server)


def test_oversized_body_is_413_before_parsing(server: ServerProcess) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": "x" * (9 * 1024**2)}).encode()
    assert_openai_error(post_raw(server, COMPLETIONS, body), 413)

    def chunks() -> Any:  # no Content-Length: the size is counted as the body arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"x" * 1024**2
        yield b'"}'

    response = httpx.post(
        f"{server.base_url}{COMPLETIONS}",
        content=chunks(),
        headers={**server.headers, "content-type": "application/json"},
        timeout=60,
    )
    assert_openai_error(response, 413)
    assert_still_serving(server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_deeply_nested_json_is_400(server: ServerProcess, path: str) -> None:
    depth = 100_000
    body = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    error = assert_openai_error(post_raw(server, path, body), 400)
    assert "nests deeper" in error["message"]
    assert_still_serving(server)


def test_brackets_inside_strings_are_not_nesting(server: ServerProcess) -> None:
    prompt = '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[ \\" {{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{ \\\\'
    body = f'{{"model": "tiny", "prompt": "{prompt}", "max_tokens": 1}}'.encode()
    assert post_raw(server, COMPLETIONS, body).status_code == 200


@pytest.mark.parametrize(
    "headers", [{"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}]
)
def test_json_body_with_another_content_type_is_4xx(server: ServerProcess, headers: dict[str, str]) -> None:
    response = post_raw(server, COMPLETIONS, b'{"model": "tiny", "prompt": "hi"}', **headers)
    assert 400 <= response.status_code < 500
    assert "error" in response.json()
    assert_still_serving(server)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hello there"}] * 20_000}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": "hello " * 500_000}]}, "messages"),
        (COMPLETIONS, {"prompt": "hello " * 1_000_000}, "prompt"),
        (COMPLETIONS, {"prompt": ["hi", "hello " * 1_000_000]}, "prompt[1]"),
    ],
)
def test_huge_prompts_are_refused_before_tokenizing(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    error = assert_openai_error(post(server, path, body, timeout=10), 400)
    assert error["param"] == param
    assert_still_serving(server)
