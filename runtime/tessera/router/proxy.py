"""Forwarding one request to one endpoint and its answer back, unchanged: status, headers and
body (an SSE stream passed on event by event as it arrives). A stream the endpoint cuts short
ends with an error event in the server's own form, then [DONE]."""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from tessera.entrypoints.serving_common import SSE_DONE, error_body

# Hop-by-hop headers (RFC 9110 7.6.1) and those the transport recomputes are never copied.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def forwarded_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _NOT_FORWARDED)


def error_json(message: str, status: int, headers: Mapping[str, str] | None = None) -> web.Response:
    """An error in OpenAI's body, as the server writes it."""
    body = json.dumps(error_body(message, status), separators=(",", ":"))
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


def sse_error_event(message: str, status: int) -> bytes:
    return f"data: {json.dumps(error_body(message, status))}\n\n{SSE_DONE}".encode()


async def relay(
    request: web.Request, upstream: aiohttp.ClientResponse, endpoint: str
) -> tuple[web.StreamResponse, bool]:
    """The endpoint's answer to the client, and whether the endpoint cut it short. A stream is
    passed on event by event as it arrives; one cut short ends with an error event (the client sees an error,
    not a stream that just stops); a cut JSON answer becomes a 502."""
    headers = forwarded_headers(upstream.headers)  # the body is passed on as sent (not decoded)
    broken = f"the endpoint {endpoint} closed the connection midway; retry the request"
    if not upstream.content_type.startswith("text/event-stream"):
        try:
            body = await upstream.read()
        except aiohttp.ClientError:
            return error_json(broken, HTTPStatus.BAD_GATEWAY), True
        return web.Response(status=upstream.status, body=body, headers=headers), False
    response = web.StreamResponse(status=upstream.status, headers=headers)
    await response.prepare(request)
    pending = b""  # an event not yet whole: passed on only whole, so a cut never splits one
    try:
        async for chunk in upstream.content.iter_any():
            pending += chunk
            end = pending.rfind(b"\n\n") + 2
            if end >= 2:
                await response.write(pending[:end])
                pending = pending[end:]
    except aiohttp.ClientError:
        await response.write(sse_error_event(broken, HTTPStatus.BAD_GATEWAY))
        await response.write_eof()
        return response, True
    await response.write(pending)
    await response.write_eof()
    return response, False
