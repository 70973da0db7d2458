"""ASGI middleware that requires the API key (``Authorization: Bearer KEY``) on the given paths.

Plain ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware hands every
body message of a response through a memory stream to another task, a cost a streamed
completion pays once per token.
"""

from __future__ import annotations

import hmac
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from tessera.entrypoints.serving_common import error_response


class ApiKeyGuard:
    def __init__(self, app: ASGIApp, api_key: str, protected_paths: tuple[str, ...]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.protected_paths = protected_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and scope["path"].startswith(self.protected_paths)
        if guarded and not self.authorized(first_header(scope, b"authorization")):
            await error_response("invalid or missing API key", HTTPStatus.UNAUTHORIZED)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, header: bytes) -> bool:
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
        scheme, _, token = header.partition(b" ")
        valid = hmac.compare_digest(token.strip(), self.api_key)
        return scheme.lower() == b"bearer" and valid


def first_header(scope: Scope, name: bytes) -> bytes:
    """The first value of header ``name`` (lower case, as ASGI gives names), as Starlette's
    ``Headers.get`` reads it; empty if absent."""
    return next((value for key, value in scope["headers"] if key == name), b"")
