"""The election's loop against the API server, and the client whose writes only a leader makes.

Standby: every retry period (jittered) read the Lease and take it when `lease.may_take` says so.
Leader: renew every retry period; a renewal that does not succeed by the end of the term
(`lease.leading_until`) ends it: `on_stopped` stops the reconciling, and `LeaderOnlyClient`
refuses any write from that instant, whether or not a pass is still running. Writes use the
Lease's resourceVersion (optimistic concurrency): of two replicas that both saw it expire, one
update wins and the other gets 409 and stays standby.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from tessera_operator.kube import ApiError, KubeClient
from tessera_operator.leadership import lease
from tessera_operator.leadership.settings import JITTER, LeaderElection

log = logging.getLogger("tessera_operator.leadership")
Hook = Callable[[], Awaitable[None]]
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class NotLeading(Exception):
    """A write asked for by a replica that does not lead (any more)."""


class LeaderOnlyClient(KubeClient):
    """A KubeClient whose writes (not dry runs) go out only while `may_write()` holds; it counts
    the writes it sent and refused (the health endpoint shows them: a standby's stay at 0)."""

    may_write: Callable[[], bool] = staticmethod(lambda: True)
    writes_sent = 0
    writes_refused = 0

    async def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        if method in WRITES and not (kwargs.get("params") or {}).get("dryRun"):
            if not self.may_write():
                self.writes_refused += 1
                raise NotLeading(f"{method} {path}: this replica does not lead")
            self.writes_sent += 1
        return await super().request(method, path, **kwargs)


class LeaderElector:
    def __init__(
        self,
        client: KubeClient,
        settings: LeaderElection,
        namespace: str,
        identity: str,
        on_started: Hook,
        on_stopped: Hook,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client, self.settings, self.identity = client, settings, identity
        self.path = lease.lease_path(namespace, settings.lease_name)
        self.namespace = namespace
        self.on_started, self.on_stopped = on_started, on_stopped
        self.monotonic, self.wall = monotonic, wall
        self.seen: lease.Observed | None = None
        self.term_end = 0.0  # monotonic; 0: not leading
        self.transitions = 0  # this process's own: became leader, stopped leading

    @property
    def duration(self) -> int:
        return math.ceil(self.settings.lease_duration_seconds)

    def is_leader(self) -> bool:
        return self.monotonic() < self.term_end

    def holder(self) -> str:
        return self.seen.record.holder if self.seen and self.seen.record else ""

    def health(self) -> dict[str, Any]:
        """For the health endpoint: who this replica is, whether it leads, whom it saw lead."""
        return {
            "lease": f"{self.namespace}/{self.settings.lease_name}",
            "identity": self.identity,
            "leader": self.is_leader(),
            "holder": self.holder(),
        }

    async def run(self) -> None:
        """Stand by, lead, and stand by again after a lost term, until cancelled."""
        retry = self.settings.retry_period_seconds
        while True:
            while not await self.try_acquire_or_renew(timeout=retry):
                await asyncio.sleep(retry * random.uniform(1.0, JITTER))
            self.transitions += 1
            log.info(
                "became the leader of lease %s/%s as %s",
                self.namespace,
                self.settings.lease_name,
                self.identity,
            )
            try:
                await self.on_started()
                await self.keep_renewing()
            finally:
                self.term_end = 0.0
                log.warning(
                    "stopped leading lease %s/%s (%s): stopped reconciling and autoscaling",
                    self.namespace, self.settings.lease_name, self.identity,
                )  # fmt: skip
                await asyncio.shield(self.on_stopped())

    async def keep_renewing(self) -> None:
        """Returns when the term ends unrenewed (the API unreachable) or another replica took the lease."""
        retry = self.settings.retry_period_seconds
        while True:
            await asyncio.sleep(retry)
            while (left := self.term_end - self.monotonic()) > 0:
                won = await self.try_acquire_or_renew(timeout=min(retry, left))
                if won:
                    break
                if won is False:  # the API answered: another replica holds the lease now
                    log.warning(
                        "lease %s/%s: now held by %s", self.namespace, self.settings.lease_name, self.holder()
                    )
                    return
                await asyncio.sleep(min(retry, max(self.term_end - self.monotonic(), 0)))
            else:
                return

    async def try_acquire_or_renew(self, timeout: float) -> bool | None:
        """One try (read, decide, write) in at most `timeout` seconds. True: this replica leads until
        `term_end`; False: another one holds the lease; None: the API failed (never an exception)."""
        sent = self.monotonic()
        try:
            won = await asyncio.wait_for(self._try(), timeout)
        except (ApiError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            log.info(
                "lease %s/%s: try failed: %s",
                self.namespace,
                self.settings.lease_name,
                exc or type(exc).__name__,
            )
            return None
        if won:
            self.term_end = lease.leading_until(sent, self.settings.renew_deadline_seconds)
        return won

    async def _try(self) -> bool:
        try:
            current: dict[str, Any] | None = await self.client.request("GET", self.path, attempts=1)
        except ApiError as exc:
            if exc.status != 404:
                raise
            current = None
        record = lease.Record.of(current) if current is not None else None
        self.seen = lease.observe(self.seen, record, self.monotonic())
        if not lease.may_take(self.seen, self.identity, self.monotonic()):
            return False
        claimed = lease.claim(record, self.identity, self.wall(), self.duration)
        try:
            written = await self.write(current, claimed)
        except ApiError as exc:
            if exc.status == 409:  # another replica wrote it first (or created it): it won
                log.info("lease %s: another replica wrote it first", self.path)
                return False
            raise
        self.seen = lease.Observed(lease.Record.of(written), self.monotonic())
        return True

    async def write(self, current: dict[str, Any] | None, record: lease.Record) -> dict[str, Any]:
        """POST a new Lease, or PUT on the resourceVersion that was read."""
        if current is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.settings.lease_name, "namespace": self.namespace},
                "spec": record.spec(),
            }
            return await self.client.request("POST", lease.lease_path(self.namespace), body=body, attempts=1)
        body = {**current, "spec": {**(current.get("spec") or {}), **record.spec()}}
        return await self.client.request("PUT", self.path, body=body, attempts=1)

    async def release(self) -> None:
        """On a graceful stop, once the reconciling stopped: if the Lease still names this replica, free
        it (on its resourceVersion), and a standby takes over at its next try."""
        self.term_end = 0.0
        try:
            current = await asyncio.wait_for(self.client.request("GET", self.path, attempts=1), 5)
            record = lease.Record.of(current)
            if record.holder != self.identity:
                return
            await asyncio.wait_for(self.write(current, lease.release(record, self.wall())), 5)
        except (ApiError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning(
                "lease %s: could not release it (a standby waits out its duration): %s", self.path, exc
            )
            return
        log.info("released lease %s/%s", self.namespace, self.settings.lease_name)
