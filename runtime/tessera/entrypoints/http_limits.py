"""What one connection may hold of the server before the application sees it: uvicorn's HTTP
protocol with a deadline and a size cap on each request's headers (slowloris).

uvicorn bounds idle keep-alive connections (timeout_keep_alive) and, with limit_concurrency,
the number of connections, but not how long a client may take to send its headers: a client
that opens a connection and dribbles a header a byte at a time holds it forever. Here every
request's headers must be complete within `timeout_header` seconds of its first byte (or of
the connection's opening) and within `max_header_size` bytes; otherwise the client gets 408
or 431 and is disconnected. The body's deadline is the BodyGuard's.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("tessera.api_server")

_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    timeout_header: float = 10.0
    max_header_size: int = 64 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        super().connection_made(transport)
        self._await_headers()

    def _await_headers(self) -> None:
        if self._header_timer is None:
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(self.timeout_header, self._headers_too_slow)

    def _headers_done(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _refuse(self, response: bytes) -> None:
        self._headers_done()
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self._refuse(_TIMEOUT)

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Counted once parsed: only what arrived while the same request's headers were still
        # incomplete (a chunk that ends them may carry the start of the body).
        waiting_for = self._header_timer
        super().data_received(data)
        if waiting_for is not None and self._header_timer is waiting_for:
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_size:
                self._refuse(_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._await_headers()  # a keep-alive connection's next request

    def on_headers_complete(self) -> None:
        self._headers_done()
        super().on_headers_complete()


def guarded_protocol(timeout_header: float, max_header_size: int) -> type[GuardedHttpToolsProtocol]:
    attributes: dict[str, Any] = {"timeout_header": timeout_header, "max_header_size": max_header_size}
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), attributes)


def raise_open_file_limit(needed: int) -> int:
    """Raise the soft RLIMIT_NOFILE towards `needed` (at most the hard limit), as vLLM's server
    does; returns the soft limit now in force. Every connection costs a file descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the open-file limit to %d: %s", target, exc)
    return soft
