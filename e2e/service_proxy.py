"""One stable local URL for a Service: 127.0.0.1:<port> forwards TCP to the Service's ready endpoints.

Bytes are forwarded both ways untouched, so streaming HTTP responses (server-sent events) pass as
they are produced. Each new connection picks the next ready address (round robin) from the
Endpoints object, re-read at most every second, so the proxy follows pods as they come and go.
As kube-proxy, it tries that one endpoint only: one that refuses the connection, or does not
answer it within a few seconds (its pod's address is gone), resets the client's connection.

    python -m e2e.service_proxy --kubeconfig K --namespace NS --service NAME --port 8000 --listen 18000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

from e2e.kube_api import KubeApi, run_until_signalled

ENDPOINTS_TTL_SECONDS = 1.0
# A deleted pod's address blackholes SYNs (nothing answers ARP): without a bound the connection
# would wait for the kernel's SYN retries, minutes.
CONNECT_TIMEOUT_SECONDS = 3.0
log = logging.getLogger("service-proxy")


def ready_targets(
    service: Mapping[str, Any], endpoints: Mapping[str, Any] | None, port: int
) -> list[tuple[str, int]]:
    """(ip, targetPort) of every ready address behind the Service's `port`."""
    service_port = next((p for p in service["spec"].get("ports", []) if p["port"] == port), None)
    if service_port is None:
        raise ValueError(f"service {service['metadata']['name']!r} has no port {port}")
    targets = []
    for subset in (endpoints or {}).get("subsets") or []:
        match = [p for p in subset.get("ports", []) if p.get("name", "") == service_port.get("name", "")]
        if not match:
            continue
        targets += [(address["ip"], int(match[0]["port"])) for address in subset.get("addresses") or []]
    return targets


class TcpForwarder:
    """Accepts connections and splices each to the upstream `_connect` picks (bytes untouched,
    half-closes passed on); one that cannot be reached resets the client's connection."""

    name = "upstream"

    def __init__(self) -> None:
        # asyncio keeps only weak references to tasks, and a client's connection drops its own
        # once the client closes: a connection still waiting on its pod was then collected
        # mid-flight ("Task was destroyed but it is pending"), its pod connection never closed.
        self._connections: set[asyncio.Task[Any]] = set()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        raise NotImplementedError

    async def handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
        try:
            upstream_reader, upstream_writer = await self._connect()
        except Exception as error:
            log.info("cannot reach %s: %r", self.name, error)
            _reset(client_writer)
            return
        peer = upstream_writer.get_extra_info("peername")
        started = time.monotonic()
        log.debug("connection to %s", peer)
        await asyncio.gather(_pipe(client_reader, upstream_writer), _pipe(upstream_reader, client_writer))
        for writer in (client_writer, upstream_writer):
            writer.close()
        log.debug("connection to %s done after %.1f s", peer, time.monotonic() - started)


class FixedForwarder(TcpForwarder):
    """Forwards every connection to one address (the node agent's way from pods to the API server)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.host, self.port = host, port
        self.name = f"{host}:{port}"

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.wait_for(asyncio.open_connection(self.host, self.port), CONNECT_TIMEOUT_SECONDS)


class ServiceProxy(TcpForwarder):
    def __init__(self, api: KubeApi, namespace: str, service: str, port: int) -> None:
        super().__init__()
        self.api = api
        self.path = f"/api/v1/namespaces/{namespace}"
        self.service = service
        self.port = port
        self.name = f"{service}:{port}"
        self._targets: list[tuple[str, int]] = []
        self._read_at = 0.0
        self._turn = itertools.count()

    async def _current_targets(self, refresh: bool = False) -> list[tuple[str, int]]:
        if refresh or time.monotonic() - self._read_at > ENDPOINTS_TTL_SECONDS:
            service = await self.api.get(f"{self.path}/services/{self.service}")
            endpoints = await self.api.get_or_none(f"{self.path}/endpoints/{self.service}")
            self._targets = ready_targets(service, endpoints, self.port)
            self._read_at = time.monotonic()
        return self._targets

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The next ready endpoint, tried once, as kube-proxy does: a pod that refuses the
        connection (it stopped listening, the Endpoints have not caught up yet) refuses the
        client too, so a leader going away shows in tests as it does to real clients."""
        targets = await self._current_targets()
        if not targets:
            raise ConnectionError(f"no ready endpoint behind {self.service}:{self.port}")
        host, port = targets[next(self._turn) % len(targets)]
        return await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_SECONDS)

    async def serve(self, listen_port: int, stop: asyncio.Event) -> None:
        server = await asyncio.start_server(self.handle, "127.0.0.1", listen_port)
        log.info("127.0.0.1:%d -> service %s port %d", listen_port, self.service, self.port)
        async with server:
            await stop.wait()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0): the client sees its connection refused or reset, as
    through kube-proxy, never a clean empty answer."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other direction may still be streaming
    except (ConnectionError, OSError):
        writer.close()  # a reset on one side ends the other side too


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.service_proxy", description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--port", type=int, required=True, help="the Service's port")
    parser.add_argument("--listen", type=int, required=True, help="local port on 127.0.0.1")
    args = parser.parse_args(argv)
    run_until_signalled(
        args.kubeconfig,
        lambda api, stop: ServiceProxy(api, args.namespace, args.service, args.port).serve(args.listen, stop),
    )


if __name__ == "__main__":
    main()
