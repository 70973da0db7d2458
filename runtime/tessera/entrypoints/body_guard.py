"""ASGI middleware that bounds a request body before anything parses it.

Only the routes that take a body (`body_paths`: POST /v1/completions, ...) have theirs read.
Every other request (probes such as /ping and /health, /metrics, unknown paths) is passed on
with its body unread, and a response to one that came with a body closes the connection, so
the rest is never read either.

On a body route, three checks on the raw bytes: the time it takes to arrive (408 past
`body_timeout` seconds, against a client that dribbles it), the size (413; Content-Length is
trusted only to refuse early, chunked bodies are counted as they arrive) and the JSON nesting
depth (400), so a body can neither exhaust memory nor drive a parser or validator into deep
recursion.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Collection, MutableMapping
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
    def __init__(
        self,
        app: ASGIApp,
        max_body_size: int,
        max_json_depth: int,
        body_paths: Collection[str] | None = None,
        body_timeout: float | None = None,
    ) -> None:
        self.app = app
        self.max_body_size = max_body_size
        self.max_json_depth = max_json_depth
        self.body_paths = None if body_paths is None else frozenset(body_paths)  # None: every path
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if self.body_paths is not None and scope["path"] not in self.body_paths:
            # Never read: a body here is not buffered, and the connection ends with the answer.
            has_body = (declared.isdigit() and int(declared) > 0) or b"transfer-encoding" in headers
            await self.app(scope, receive, _closing(send) if has_body else send)
            return
        if declared.isdigit() and int(declared) > self.max_body_size:
            await self._reject(scope, receive, send, *self._too_large())
            return
        try:
            async with asyncio.timeout(self.body_timeout):
                body = await self._read(receive)
        except TimeoutError:
            message_text = f"the request body did not arrive within {self.body_timeout:g} seconds"
            response = error_response(
                message_text, HTTPStatus.REQUEST_TIMEOUT, headers={"Connection": "close"}
            )
            await response(scope, receive, send)
            return
        if body is None:  # the client left before sending its body
            return
        if isinstance(body, int):
            await self._reject(scope, receive, send, *self._too_large())
            return
        if json_depth(body) > self.max_json_depth:
            message_text = f"the request body nests deeper than {self.max_json_depth} levels"
            await self._reject(scope, receive, send, message_text, HTTPStatus.BAD_REQUEST)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | int | None:
        """The whole body; its size so far once over the cap; None when the client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_size:
                return size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> tuple[str, int]:
        return (
            f"the request body is larger than {self.max_body_size} bytes",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )

    @staticmethod
    async def _reject(scope: Scope, receive: Receive, send: Send, message: str, status: int) -> None:
        # A body refused unread (413) is not read to its end either: the connection closes.
        headers = {"Connection": "close"} if status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE else None
        await error_response(message, status, headers=headers)(scope, receive, send)


def _closing(send: Send) -> Send:
    """`send` with `Connection: close` on the response: the body it leaves unread is never read."""

    async def closing_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing_send


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
