"""Where the leaders are: an EndpointSource publishes the set of endpoint base URLs, then each
change. StaticEndpointSource: URLs from flags and a file (one per line) re-read while it runs,
for tests and for the operator to mount a ConfigMap; kube_source.KubernetesEndpointSource: the
Ready leader pods of one InferenceCluster."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

logger = logging.getLogger("tessera.router")

Publish = Callable[[frozenset[str]], None]


class EndpointSource(Protocol):
    async def run(self, publish: Publish) -> None:
        """Call ``publish`` with the current set, then again on every change, until cancelled."""


class EndpointsFileError(ValueError):
    pass


def normalize_endpoint(url: str, where: str) -> str:
    """`http(s)://host[:port]` without a trailing slash; ``where`` names the flag or file line."""
    text = url.strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise EndpointsFileError(f"{where}: {url!r} is not an endpoint base URL (http://host:port)")
    return text


def parse_endpoints_file(text: str, path: Path) -> frozenset[str]:
    """One base URL per line; blank lines and `#` comments are skipped."""
    endpoints = set()
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if entry:
            endpoints.add(normalize_endpoint(entry, f"endpoints file {path} line {number}"))
    return frozenset(endpoints)


class StaticEndpointSource:
    def __init__(
        self, endpoints: Iterable[str] = (), file: Path | None = None, reload_interval_s: float = 1.0
    ) -> None:
        self.fixed = frozenset(normalize_endpoint(e, "--endpoint") for e in endpoints)
        self.file = file
        self.reload_interval_s = reload_interval_s
        self._file_endpoints = self._read() if file is not None else frozenset()  # a bad file stops start-up

    def _read(self) -> frozenset[str]:
        assert self.file is not None
        try:
            text = self.file.read_text()
        except OSError as exc:
            raise EndpointsFileError(f"endpoints file {self.file}: {exc.strerror}") from exc
        return parse_endpoints_file(text, self.file)

    def current(self) -> frozenset[str]:
        return self.fixed | self._file_endpoints

    async def run(self, publish: Publish) -> None:
        published = self.current()
        publish(published)
        if self.file is None:
            return
        while True:
            await asyncio.sleep(self.reload_interval_s)
            try:
                self._file_endpoints = self._read()
            except EndpointsFileError as exc:  # a file being rewritten: keep the last good set
                logger.warning("%s; keeping the %d endpoints read before", exc, len(self._file_endpoints))
                continue
            if self.current() != published:
                published = self.current()
                logger.info("endpoints now: %s", ", ".join(sorted(published)) or "(none)")
                publish(published)
