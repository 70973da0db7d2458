"""The router's HTTP server (aiohttp): OpenAI's generation routes scored and proxied, the model
list and tokenizer routes proxied by load, /health and /metrics answered here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web

from tessera.router.endpoints import EndpointSource
from tessera.router.hold import HoldRoom
from tessera.router.load import LoadPoller
from tessera.router.metrics import RouterMetrics
from tessera.router.prompt_hashes import CHAT, COMPLETIONS, PromptHasher
from tessera.router.proxy import error_json, forwarded_headers, relay
from tessera.router.routing import RoutingState
from tessera.router.scorer import Decision, ScoreWeights

logger = logging.getLogger("tessera.router")

# Below uvicorn's keep-alive (5 s, `tessera serve --timeout-keep-alive`): the router never sends
# a request on a pooled connection the leader is closing.
UPSTREAM_KEEPALIVE_S = 3.0
PROXIED_POSTS = ("/tokenize", "/detokenize")  # routed on load: they hold no KV blocks


@dataclass(frozen=True)
class RouterSettings:
    session_header: str = "x-session-id"
    max_body_size: int = 16 * 1024 * 1024
    retry_after_s: int = 1
    poll_interval_s: float = 1.0
    connect_timeout_s: float = 5.0
    weights: ScoreWeights = field(default_factory=ScoreWeights)
    prefix_index_entries: int = 100_000
    session_entries: int = 100_000
    hold_max: int = 0  # 0: no hold, a request at zero endpoints is answered 503 at once
    hold_timeout_s: float = 30.0


class Router:
    def __init__(self, settings: RouterSettings, source: EndpointSource, hasher: PromptHasher | None) -> None:
        self.settings = settings
        self.source = source
        self.hasher = hasher
        self.metrics = RouterMetrics()
        self.hold = HoldRoom(settings.hold_max, settings.hold_timeout_s)
        self.metrics.held.set_function(lambda: self.hold.held)
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-router-tokenizer")
        self.session: aiohttp.ClientSession
        self.state: RoutingState

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_size)
        app.cleanup_ctx.append(self._lifetime)
        app.router.add_post(COMPLETIONS, self.generation)
        app.router.add_post(CHAT, self.generation)
        for path in PROXIED_POSTS:
            app.router.add_post(path, self.by_load)
        app.router.add_get("/v1/models", self.by_load)
        app.router.add_get("/v1/models/{model:.+}", self.by_load)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.render_metrics)
        return app

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        s = self.settings
        self.state = RoutingState(
            lambda on_change: LoadPoller(self.session, s.poll_interval_s, on_change),
            s.weights,
            s.prefix_index_entries,
            s.session_entries,
            self.hold,
            self.metrics,
        )
        tasks = [
            asyncio.create_task(self.source.run(self.state.set_endpoints), name="endpoint-source"),
            asyncio.create_task(self.state.poller.run(), name="load-poller"),
        ]
        yield
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.session.close()
        self._tokenizer_pool.shutdown(wait=False)

    # --- routes answered here ---------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 while the router runs, even at zero endpoints: it holds or refuses requests itself."""
        return web.json_response({"ready_endpoints": len(self.state.ready())})

    async def render_metrics(self, request: web.Request) -> web.Response:
        body = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # --- proxied routes ---------------------------------------------------------------------
    async def generation(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        hashes: list[bytes] = []
        if self.hasher is not None:
            parsed = _json_or_none(body)
            if isinstance(parsed, dict):
                loop = asyncio.get_running_loop()
                hashes = await loop.run_in_executor(
                    self._tokenizer_pool, self.hasher.hashes, request.path, parsed
                )
        session = request.headers.get(self.settings.session_header) or None
        return await self._forward(request, body, hashes, session, scored=True)

    async def by_load(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        return await self._forward(request, body, [], None, scored=False)

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        limit = self.settings.max_body_size
        too_large = error_json(
            f"the request body is larger than {limit} bytes (the router's --max-body-size)",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )
        if request.content_length is not None and request.content_length > limit:
            return too_large
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return too_large

    async def _forward(
        self, request: web.Request, body: bytes, hashes: list[bytes], session: str | None, scored: bool
    ) -> web.StreamResponse:
        """To the best Ready endpoint; one that refuses the connection is marked down and the
        next best tried (the request never reached it, so nothing runs twice)."""
        unreachable: set[str] = set()
        arrived_at_zero = False
        while True:
            decision = self.state.pick(hashes, session, exclude=unreachable)
            if decision is None:
                if unreachable:
                    message = f"no endpoint could be reached ({len(unreachable)} tried); retry later"
                    return self._unavailable(message, "unreachable")
                if not arrived_at_zero:
                    self.metrics.at_zero.inc()
                    arrived_at_zero = True
                waited = await self._wait_for_endpoint()
                if isinstance(waited, web.Response):
                    return waited
                continue
            if scored:
                self.metrics.decisions.labels(decision.reason).inc()
            response = await self._send(request, body, decision)
            if response is not None:
                return response
            unreachable.add(decision.endpoint)

    async def _wait_for_endpoint(self) -> web.Response | None:
        """None once an endpoint is Ready; else the 503 (no hold, the hold full, its timeout)."""
        hold = self.hold
        if hold.held >= hold.max_held:
            reason = "no_endpoint" if hold.max_held == 0 else "hold_full"
            return self._unavailable("no endpoint is ready to serve; retry later", reason)
        if await hold.wait_for(lambda: bool(self.state.ready())):
            return None
        return self._unavailable(
            f"no endpoint became ready within {hold.timeout_s:g} s; retry later", "hold_timeout"
        )

    def _unavailable(self, message: str, reason: str) -> web.Response:
        self.metrics.unavailable.labels(reason).inc()
        headers = {"Retry-After": str(self.settings.retry_after_s)}
        return error_json(message, HTTPStatus.SERVICE_UNAVAILABLE, headers)

    async def _send(self, request: web.Request, body: bytes, decision: Decision) -> web.StreamResponse | None:
        """The endpoint's answer relayed; None when it refused the connection."""
        endpoint = decision.endpoint
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s)
        self.state.opened(endpoint)
        try:
            async with self.session.request(
                request.method,
                endpoint + request.path_qs,
                data=body or None,
                headers=forwarded_headers(request.headers),
                timeout=timeout,
            ) as upstream:
                response, broken = await relay(request, upstream, endpoint)
                if broken:
                    self.metrics.upstream_errors.labels(endpoint, "midstream").inc()
                return response
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            logger.warning("cannot connect to %s (%s): trying another endpoint", endpoint, exc)
            self.metrics.upstream_errors.labels(endpoint, "connect").inc()
            self.state.poller.mark_unhealthy(endpoint)
            return None
        except aiohttp.ClientError as exc:  # it took the request and failed before answering
            logger.warning("%s failed before answering: %s", endpoint, exc)
            self.metrics.upstream_errors.labels(endpoint, "response").inc()
            return error_json(
                f"the endpoint {endpoint} failed before answering ({type(exc).__name__}); retry the request",
                HTTPStatus.BAD_GATEWAY,
            )
        finally:
            self.state.closed(endpoint)


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:  # the leader answers a malformed body with its 400
        return None
