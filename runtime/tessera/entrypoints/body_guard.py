"""ASGI middleware that bounds a request body before anything parses it.

Two checks on the raw bytes: the size (413; Content-Length is trusted only to refuse early,
chunked bodies are counted as they arrive) and the JSON nesting depth (400), so a body can
neither exhaust memory nor drive a parser or validator into deep recursion.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

import numpy as np

from tessera.entrypoints.serving_common import error_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """Deepest nesting of arrays/objects in a JSON text, in linear time without parsing it.

    Escapes are dropped first (pairs of backslashes, then escaped quotes), so every quote
    left delimits a string; strings are dropped next, so every bracket left is structure.
    """
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRING.sub(b"", unescaped).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


class BodyGuard:
    def __init__(self, app: ASGIApp, max_body_size: int, max_json_depth: int) -> None:
        self.app = app
        self.max_body_size = max_body_size
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_size:
            await self._reject(scope, receive, send, *self._too_large())
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_size:
                await self._reject(scope, receive, send, *self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if json_depth(body) > self.max_json_depth:
            message_text = f"the request body nests deeper than {self.max_json_depth} levels"
            await self._reject(scope, receive, send, message_text, HTTPStatus.BAD_REQUEST)
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> tuple[str, int]:
        return (
            f"the request body is larger than {self.max_body_size} bytes",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )

    @staticmethod
    async def _reject(scope: Scope, receive: Receive, send: Send, message: str, status: int) -> None:
        await error_response(message, status)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body as one message, then the client's own messages (e.g. its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
