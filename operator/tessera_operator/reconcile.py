"""One reconciliation pass for one InferenceCluster: read everything, plan, write the difference.

Reads fresh state each pass (the object, its pods and Services) rather than trusting events,
records intent in status *before* destructive actions (so a crash mid-pass never loses a
backoff deadline), creates pods under stable names (a repeated create is a harmless 409) and
deletes with a uid precondition (never a newer incarnation of the same name).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from tessera_operator import api, builders, naming
from tessera_operator.api import InferenceClusterSpec, InferenceClusterStatus
from tessera_operator.kube import ApiError, KubeClient, core_path, custom_path
from tessera_operator.observe import observe
from tessera_operator.planner import Event, plan
from tessera_operator.status import build_status, invalid_status
from tessera_operator.timeutil import to_rfc3339
from tessera_operator.validation import validate_object

log = logging.getLogger("tessera_operator.reconcile")
COMPONENT = "tessera-operator"


class Reconciler:
    def __init__(
        self, client: KubeClient, resync_seconds: float = 30.0, clock: Callable[[], float] = time.time
    ):
        self.client = client
        self.resync_seconds = resync_seconds
        self.clock = clock

    async def reconcile(self, namespace: str, name: str) -> float | None:
        """Returns when to look again (seconds), or None when the object is gone."""
        ic_path = custom_path(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        try:
            ic = await self.client.get(ic_path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        meta = ic["metadata"]
        if meta.get("deletionTimestamp"):
            return None  # the garbage collector removes what we own
        ref = builders.ClusterRef(name, namespace, meta["uid"])
        generation = meta.get("generation")
        previous = InferenceClusterStatus.model_validate(ic.get("status") or {})
        now = self.clock()

        errors = validate_object(name, ic.get("spec") or {})
        if errors:
            message = "; ".join(str(e) for e in errors)
            status = invalid_status(previous, generation, message, now)
            if await self.write_status(ic_path, previous, status):
                await self.post_events(ref, [Event("Warning", "InvalidSpec", message)])
            return None

        spec = InferenceClusterSpec.model_validate(ic["spec"])
        revision = builders.revision_of(spec)
        selector = naming.selector_string(naming.cluster_selector(name))
        pods, services = await asyncio.gather(
            self.client.list(core_path(namespace, "pods"), selector),
            self.client.list(core_path(namespace, "services"), selector),
        )
        observation = observe(name, ref.uid, pods)
        prior = {g.index: g for g in previous.groups}
        decision = plan(spec, revision, observation, prior, now)
        status = build_status(
            name, generation, spec, revision, decision, builders.endpoint_of(ref), previous, now
        )
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
        existing = {p["metadata"]["name"] for p in pods}
        to_create = [
            pod
            for index in decision.create_groups
            for pod in builders.build_group(ref, spec, revision, index)
            if pod["metadata"]["name"] not in existing
        ]
        writes = [
            *(self.create(core_path(namespace, "pods"), pod) for pod in to_create),
            self.ensure_services(ref, services),
        ]
        if decision.delete_pods:
            # Intent first: a backoff deadline or an Updating mark must survive a crash mid-pass.
            await self.write_status(ic_path, previous, status)
            await asyncio.gather(
                *(self.delete_pod(namespace, pod, uids.get(pod)) for pod in decision.delete_pods), *writes
            )
        else:
            await asyncio.gather(self.write_status(ic_path, previous, status), *writes)
        log.debug(
            "%s/%s: %d pods seen, %d created, %d deleted, groups %s",
            namespace, name, len(pods), len(to_create), len(decision.delete_pods),
            [(g.index, g.phase) for g in status.groups],
        )  # fmt: skip
        await self.post_events(ref, decision.events)
        if decision.events:
            log.info("%s/%s: %s", namespace, name, "; ".join(e.message for e in decision.events))
        return min(decision.requeue_after or self.resync_seconds, self.resync_seconds)

    async def write_status(
        self, ic_path: str, previous: InferenceClusterStatus, status: InferenceClusterStatus
    ) -> bool:
        new = status.wire()
        old = previous.wire()
        if new == old:
            return False
        body: dict[str, Any] = {key: None for key in old if key not in new}  # merge patch: null deletes
        body.update(new)
        await self.client.merge_patch(ic_path + "/status", {"status": body})
        return True

    async def create(self, path: str, body: dict[str, Any]) -> None:
        try:
            await self.client.create(path, body)
        except ApiError as exc:
            if exc.status != 409:  # 409: it exists (or its predecessor still terminates)
                raise

    async def delete_pod(self, namespace: str, name: str, uid: str | None) -> None:
        try:
            await self.client.delete(core_path(namespace, "pods", name), uid=uid)
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone already, or replaced by a newer incarnation
                raise

    async def ensure_services(self, ref: builders.ClusterRef, services: Iterable[dict[str, Any]]) -> None:
        existing = {s["metadata"]["name"]: s for s in services}
        for desired in (builders.build_headless_service(ref), builders.build_client_service(ref)):
            name = desired["metadata"]["name"]
            current = existing.get(name)
            path = core_path(ref.namespace, "services")
            if current is None:
                await self.create(path, desired)
            elif service_drifted(current, desired):
                if desired["spec"].get("clusterIP") == "None" and current["spec"].get("clusterIP") != "None":
                    await self.client.delete(
                        core_path(ref.namespace, "services", name), uid=current["metadata"]["uid"]
                    )
                    await self.create(path, desired)  # clusterIP is immutable: recreate
                else:
                    fixed = dict(current)
                    fixed["spec"] = {**current["spec"], **desired["spec"]}
                    fixed["metadata"] = {
                        **current["metadata"],
                        "ownerReferences": desired["metadata"]["ownerReferences"],
                    }
                    await self.client.request("PUT", core_path(ref.namespace, "services", name), body=fixed)

    async def post_events(self, ref: builders.ClusterRef, events: list[Event]) -> None:
        now = to_rfc3339(self.clock())
        for event in events:
            body = {
                "metadata": {"generateName": f"{ref.name}.", "namespace": ref.namespace},
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
            try:
                await self.client.create(core_path(ref.namespace, "events"), body)
            except ApiError as exc:  # events are best effort: never fail a pass over one
                log.warning("could not post event %s: %s", event.reason, exc)


def service_drifted(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    cur, want = current.get("spec", {}), desired["spec"]
    if cur.get("selector") != want["selector"]:
        return True
    if bool(cur.get("publishNotReadyAddresses")) != bool(want.get("publishNotReadyAddresses")):
        return True
    if want.get("clusterIP") == "None" and cur.get("clusterIP") != "None":
        return True
    strip = [{k: p.get(k) for k in ("name", "port", "targetPort", "protocol")} for p in cur.get("ports", [])]
    if strip != want["ports"]:
        return True
    owners = [o.get("uid") for o in current["metadata"].get("ownerReferences") or []]
    return desired["metadata"]["ownerReferences"][0]["uid"] not in owners
