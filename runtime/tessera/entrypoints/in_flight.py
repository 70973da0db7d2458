"""The server's own count of open model requests, for `tessera drain` (drain.py).

Counted at the HTTP layer, from the request's arrival to its answer's last byte (a stream's
included): the engine's gauges count only what reached the scheduler, and update per step.
"""

from __future__ import annotations

from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

IN_FLIGHT_PATH = "/in-flight"


class InFlight:
    """Open requests to `paths`; `count` is read by the /in-flight route."""

    def __init__(self, paths: Collection[str]) -> None:
        self.paths = frozenset(paths)
        self.count = 0


class InFlightCounter:
    """ASGI middleware: `in_flight.count` is the number of requests to its paths not yet answered."""

    def __init__(self, app: ASGIApp, in_flight: InFlight) -> None:
        self.app, self.in_flight = app, in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.in_flight.paths:
            await self.app(scope, receive, send)
            return
        self.in_flight.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.count -= 1
