"""ApiKeyGuard: the key is required on the protected paths, and a response passes through as it is
sent, in the caller's task (a streamed completion pays no per-token relay)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest
from starlette.middleware.base import BaseHTTPMiddleware

from tessera.entrypoints.api_key import ApiKeyGuard
from tessera.entrypoints.api_server import PROTECTED_PATHS, build_app
from tessera.entrypoints.serving_common import ServingContext

KEY = "sk-guard-test"
BODY_PARTS = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]


async def streaming_app(scope: Any, receive: Any, send: Any) -> None:
    scope["app_task"] = asyncio.current_task()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for part in BODY_PARTS:
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def call(path: str, authorization: bytes | None) -> list[dict[str, Any]]:
    """The messages the guard sends for one request; the app behind it must run, and every
    message go out, in the caller's own task."""
    headers = [(b"authorization", authorization)] if authorization is not None else []
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}
    sent: list[dict[str, Any]] = []
    tasks: set[object] = set()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(dict(message))
        tasks.add(asyncio.current_task())

    async def run() -> object:
        await ApiKeyGuard(streaming_app, KEY, PROTECTED_PATHS)(scope, receive, send)
        return asyncio.current_task()

    caller = asyncio.run(run())
    tasks.add(scope.get("app_task", caller))
    assert tasks == {caller}, "the response was relayed through another task"
    return sent


@pytest.mark.parametrize(
    "authorization", [None, b"", b"Bearer", b"Bearer wrong", b"Basic " + KEY.encode(), KEY.encode()]
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models", "/tokenize", "/detokenize"])
def test_a_missing_or_wrong_key_is_401_in_openai_format(path: str, authorization: bytes | None) -> None:
    sent = call(path, authorization)
    assert sent[0]["status"] == 401
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["message"] == "invalid or missing API key" and KEY not in json.dumps(error)


@pytest.mark.parametrize("scheme", [b"Bearer", b"bearer", b"BEARER"])
def test_the_key_passes_a_streamed_response_through_unchanged(scheme: bytes) -> None:
    sent = call("/v1/completions", scheme + b" " + KEY.encode() + b" ")
    assert sent[0]["status"] == 200
    assert [m["body"] for m in sent[1:-1]] == BODY_PARTS


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/ping"])
def test_probes_and_metrics_need_no_key(path: str) -> None:
    sent = call(path, None)
    assert sent[0]["status"] == 200


def test_no_middleware_of_the_app_relays_responses_through_a_task() -> None:
    """BaseHTTPMiddleware (what ``@app.middleware("http")`` adds) moves every body message of a
    response through a memory stream to another task: none of the server's middleware may be one."""
    ctx = ServingContext(engine=cast(Any, None), served_model_names=["model"])
    app = build_app(ctx, api_key=KEY, allowed_origins=["https://example.test"])
    classes = [cast(type, middleware.cls) for middleware in app.user_middleware]
    assert ApiKeyGuard in classes
    assert not [cls for cls in classes if issubclass(cls, BaseHTTPMiddleware)]
