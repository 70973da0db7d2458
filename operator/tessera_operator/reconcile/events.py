"""Kubernetes Events about an InferenceCluster, posted as client-go's correlator keeps them.

One Event object per (object, type, reason, message): a repeat, or a POST retried after a lost
answer, bumps its count instead of adding another object. Events are best effort: a failed post
is logged and never fails a pass.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera_operator import api
from tessera_operator.builders import ClusterRef
from tessera_operator.kube import ApiError, KubeClient, core_path
from tessera_operator.timeutil import to_rfc3339

log = logging.getLogger("tessera_operator.reconcile.events")
COMPONENT = "tessera-operator"
EVENT_COUNTS_KEPT = 4096


@dataclass
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def event_name(ref: ClusterRef, event: Event) -> str:
    """A stable name for one kind of Event about one object (the same inputs, the same name)."""
    digest = hashlib.sha256(f"{ref.uid}\0{event.type}\0{event.reason}\0{event.message}".encode()).hexdigest()
    return f"{ref.name}.{digest[:16]}"


def event_body(ref: ClusterRef, event: Event, name: str, now: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ref.namespace},
        "involvedObject": {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "name": ref.name,
            "namespace": ref.namespace,
            "uid": ref.uid,
        },
        "reason": event.reason,
        "message": event.message[:1000],
        "type": event.type,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class EventRecorder:
    def __init__(self, client: KubeClient, clock: Callable[[], float]) -> None:
        self.client = client
        self.clock = clock
        # Occurrences of each Event this process posted (by name, least recent first), so a
        # repeat bumps the count; bounded like client-go's correlator cache.
        self._counts: dict[str, int] = {}

    async def post(self, ref: ClusterRef, events: list[Event]) -> None:
        now = to_rfc3339(self.clock())
        path = core_path(ref.namespace, "events")
        for event in events:
            name = event_name(ref, event)
            try:
                await self._create_or_count(path, name, event_body(ref, event, name, now), now)
            except ApiError as exc:  # events are best effort: never fail a pass over one
                log.warning("could not post event %s: %s", event.reason, exc)

    async def _create_or_count(self, path: str, name: str, body: dict[str, Any], now: str) -> None:
        try:
            await self.client.create(path, body)
            count = 1
        except ApiError as exc:
            if exc.status != 409:
                raise
            count = self._counts.pop(name, 1) + 1
            await self.client.merge_patch(f"{path}/{name}", {"count": count, "lastTimestamp": now})
        self._counts[name] = count  # re-inserted last: the oldest entries go first
        if len(self._counts) > EVENT_COUNTS_KEPT:
            del self._counts[next(iter(self._counts))]
