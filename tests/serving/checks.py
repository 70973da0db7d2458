"""Assertions the serving tests share: OpenAI error bodies, and a server that still serves."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from tests.serving.server import MODEL_NAME, ServerProcess


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text and ".py" not in response.text, response.text
    return error


def assert_still_serving(server: ServerProcess) -> None:
    """/health is 200 and a normal request completes, through the openai client."""
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key or "unused", max_retries=0, timeout=60
    )
    completion = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=3)
    assert completion.choices[0].finish_reason in ("length", "stop")
