"""The writes of a pass: each applies one plan (or the desired objects) to the API server.

Creates under stable names (a repeated create is a harmless 409), deletes with a uid
precondition (never a newer incarnation of the same name). A write the API server refuses for
good (422, 403 from a quota or a Role, an object of our name that is not ours) becomes a
WriteRefused, which the pass reports as Degraded; transient errors (5xx, timeouts) raise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

from tessera_operator import builders, naming
from tessera_operator.api import InferenceClusterSpec, InferenceClusterStatus
from tessera_operator.builders import ClusterRef
from tessera_operator.kube import RETRYABLE, ApiError, KubeClient, core_path, custom_path
from tessera_operator.reconcile.model_cache_writes import (
    MODEL_CACHE_UNAVAILABLE,
    ModelCacheUnavailable,
    write_model_cache,
)
from tessera_operator.reconcile.observe import controlled_by, is_orphaned
from tessera_operator.reconcile.owned_plans import (
    ServicePlan,
    adoption,
    plan_budget,
    repaired_service,
)
from tessera_operator.reconcile.pod_group_writes import SchedulerUnavailable, write_pod_groups
from tessera_operator.reconcile.router_writes import NotOurs, PoolUnavailable, write_router
from tessera_operator.reconcile.status import merge_patch

log = logging.getLogger("tessera_operator.reconcile.writes")
FAILED_CREATE, FAILED_DELETE, FAILED_SCALE = "FailedCreate", "FailedDelete", "FailedScale"
POOL_UNAVAILABLE = "InferencePoolUnavailable"
SCHEDULER_UNAVAILABLE = "SchedulerUnavailable"  # spec.scheduling names a scheduler the cluster lacks


class WriteRefused(Exception):
    """The API server refused a write for good (4xx other than a conflict): report it, retry at resync."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def refusal(reason: str, what: str, exc: ApiError) -> Exception:
    """A WriteRefused naming the object and the API server's message, or `exc` itself if transient."""
    if exc.status in RETRYABLE or exc.status < 400:
        return exc
    return WriteRefused(reason, f"{what}: {exc}")


def not_ours(reason: str, what: str, kind: str) -> WriteRefused:
    return WriteRefused(
        reason, f"{what}: a {kind} of that name exists and is not this cluster's; rename or delete it"
    )


async def refused_writes(writes: Iterable[Awaitable[Any]]) -> list[WriteRefused]:
    """Runs the writes at once; returns those refused for good, raises anything transient."""
    results = await asyncio.gather(*writes, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, WriteRefused):
            raise result
    return [r for r in results if isinstance(r, WriteRefused)]


class Writes:
    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self._policy_version: str | None = None  # of PodDisruptionBudgets, once discovered

    async def status(
        self, ic_path: str, previous: InferenceClusterStatus, status: InferenceClusterStatus
    ) -> bool:
        body = merge_patch(previous.wire(), status.wire())
        if not body:
            return False
        await self.client.merge_patch(ic_path + "/status", {"status": body})
        return True

    async def create(self, path: str, body: dict[str, Any]) -> bool:
        """Create; False if an object of that name exists already (or its predecessor still terminates)."""
        try:
            await self.client.create(path, body)
        except ApiError as exc:
            if exc.status == 409:
                return False
            what = f"creating {body.get('kind', 'object').lower()} {body['metadata']['name']}"
            raise refusal(FAILED_CREATE, what, exc) from exc
        return True

    async def delete_pod(self, namespace: str, name: str, uid: str | None, leader: bool = False) -> None:
        """A leader is first marked leaving: the router sends it nothing new while its preStop
        hook waits for what it has (its delete alone would tell the router as soon)."""
        path = core_path(namespace, "pods", name)
        try:
            if leader:
                await self.client.merge_patch(path, {"metadata": {"labels": {naming.LEAVING_LABEL: "true"}}})
            await self.client.delete(path, uid=uid)
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone already, or replaced by a newer incarnation
                raise refusal(FAILED_DELETE, f"deleting pod {name}", exc) from exc

    async def scale(self, ic_path: str, version: str | None, replicas: int) -> None:
        """spec.replicas through the scale subresource, only on the object as read (`version`):
        replicas set meanwhile (`kubectl scale`, a GitOps sync) win with a 409."""
        scale = {"metadata": {"resourceVersion": version}, "spec": {"replicas": replicas}}
        await self.client.merge_patch(ic_path + "/scale", scale)

    async def adopt(self, ref: ClusterRef, orphan: dict[str, Any]) -> dict[str, Any]:
        path = core_path(ref.namespace, "pods", orphan["metadata"]["name"])
        return dict(await self.client.merge_patch(path, adoption(orphan, ref)))

    async def services(self, ref: ClusterRef, plans: Iterable[ServicePlan]) -> None:
        path = core_path(ref.namespace, "services")
        for plan in plans:
            if plan.action == "create":
                if not await self.create(path, plan.desired):  # it exists, yet without our labels
                    await self.check_service_is_ours(ref, plan.name)
            elif plan.action == "not_ours":
                raise not_ours(FAILED_CREATE, f"creating service {plan.name}", "Service")
            elif plan.action in ("repair", "replace"):
                try:
                    await self.repair_service(ref, plan)
                except ApiError as exc:
                    if exc.status not in (404, 409):  # gone or changed meanwhile: look again next pass
                        raise refusal(FAILED_CREATE, f"repairing service {plan.name}", exc) from exc

    async def check_service_is_ours(self, ref: ClusterRef, name: str) -> None:
        """After a conflict: a Service of that name that is someone else's is said so, rather than
        status.endpoint pointing at another application."""
        try:
            service = await self.client.get(core_path(ref.namespace, "services", name))
        except ApiError as exc:
            if exc.status == 403:  # a Role from before this check (no services/get): not checked
                log.warning("%s/%s: cannot read service %s: %s", ref.namespace, ref.name, name, exc)
                return
            if exc.status == 404:
                return  # gone meanwhile: the next pass creates it
            raise
        if not controlled_by(service, ref.uid):
            raise not_ours(FAILED_CREATE, f"creating service {name}", "Service")

    async def repair_service(self, ref: ClusterRef, plan: ServicePlan) -> None:
        assert plan.current is not None
        path = core_path(ref.namespace, "services", plan.name)
        if plan.action == "replace":
            await self.client.delete(path, uid=plan.current["metadata"]["uid"])
            await self.create(core_path(ref.namespace, "services"), plan.desired)
            return
        await self.client.request("PUT", path, body=repaired_service(plan.current, plan.desired))

    async def policy_version(self) -> str:
        """policy/v1 where the API server has it (1.21+), else policy/v1beta1 (gone in 1.25)."""
        if self._policy_version is None:
            try:
                await self.client.get("/apis/policy/v1")
                self._policy_version = "v1"
            except ApiError as exc:
                if exc.status != 404:
                    raise
                self._policy_version = "v1beta1"
        return self._policy_version

    async def read_owned(self, path: str, what: str) -> dict[str, Any] | None:
        """One object the cluster keeps, or None where there is none; a refused read is reported."""
        try:
            return dict(await self.client.get(path))
        except ApiError as exc:
            if exc.status != 404:
                raise refusal(FAILED_CREATE, f"reading {what}", exc) from exc
            return None

    async def disruption_budget(self, ref: ClusterRef, spec: InferenceClusterSpec, surge_groups: int) -> None:
        version = await self.policy_version()
        path = custom_path("policy", version, ref.namespace, "poddisruptionbudgets")
        desired = builders.build_disruption_budget(ref, spec, f"policy/{version}", surge_groups)
        what = f"poddisruptionbudget {ref.name}"
        plan = plan_budget(ref, desired, await self.read_owned(f"{path}/{ref.name}", what))
        if plan.action == "not_ours":
            raise not_ours(FAILED_CREATE, f"updating {what}", "PodDisruptionBudget")
        try:
            if plan.action == "delete":
                await self.client.delete(f"{path}/{ref.name}", uid=plan.uid)
            elif plan.action == "create" and plan.body is not None:
                await self.create(path, plan.body)
            elif plan.action in ("adopt", "patch") and plan.body is not None:
                await self.client.merge_patch(f"{path}/{ref.name}", plan.body)
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone or changed meanwhile: the next pass looks again
                raise refusal(FAILED_CREATE, f"updating {what}", exc) from exc

    async def group_secret(self, ref: ClusterRef, groups: Iterable[int]) -> None:
        """The cluster's Secret holds a key for each of `groups`: created with them, or given the
        missing ones. Keys are never rotated (a group's running pods hold theirs). A Secret of that
        name the cluster does not control is refused, not used: its author would know the keys.
        Values never reach a log, an Event or status: messages name the Secret and keys only."""
        name = naming.group_secret_name(ref.name)
        path = core_path(ref.namespace, "secrets")
        current = await self.read_owned(f"{path}/{name}", f"secret {name}")
        if current is None:
            body = builders.build_group_secret(ref, builders.missing_group_keys({}, groups))
            if not await self.create(path, body):
                raise ApiError(409, f"secret {name} was created meanwhile")  # transient: look again
            return
        orphaned = is_orphaned(current, ref.name)
        if not orphaned and not controlled_by(current, ref.uid):
            raise not_ours(FAILED_CREATE, f"creating secret {name}", "Secret")
        missing = builders.missing_group_keys(current.get("data") or {}, groups)
        if not missing and not orphaned:
            return
        # resourceVersion: a concurrent writer's keys are never overwritten (409, looked at again).
        version = current["metadata"].get("resourceVersion")
        patch: dict[str, Any] = {"metadata": {"resourceVersion": version} if version else {}}
        if orphaned:  # left by an orphaning delete: the next cluster of the name adopts it
            patch["metadata"].update(adoption(current, ref)["metadata"])
        if missing:
            patch["data"] = missing
        try:
            await self.client.merge_patch(f"{path}/{name}", patch)
        except ApiError as exc:
            if exc.status == 409:
                raise
            raise refusal(FAILED_CREATE, f"adding keys {sorted(missing)} to secret {name}", exc) from exc
        if missing:
            log.info("%s/%s: secret %s: keys %s added", ref.namespace, ref.name, name, sorted(missing))

    async def network_policies(self, ref: ClusterRef, spec: InferenceClusterSpec) -> None:
        """The NetworkPolicies of spec.networkPolicy; this cluster's own are removed when it is off.
        Without rights on NetworkPolicies (a Role from before them) and none wanted: nothing to do."""
        desired = {p["metadata"]["name"]: p for p in builders.build_network_policies(ref, spec)}
        path = custom_path("networking.k8s.io", "v1", ref.namespace, "networkpolicies")
        selector = naming.selector_string(naming.cluster_selector(ref.name))
        try:
            listed = await self.client.list(path, selector)
        except ApiError as exc:
            if not desired and exc.status in (403, 404):
                return
            raise refusal(FAILED_CREATE, "listing networkpolicies", exc) from exc
        current = {p["metadata"]["name"]: p for p in listed}
        try:
            for name in sorted(set(naming.network_policy_names(ref.name))):
                await self._network_policy(ref, path, name, current.get(name), desired.get(name))
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone or changed meanwhile: the next pass looks again
                raise refusal(FAILED_CREATE, "updating networkpolicies", exc) from exc

    async def _network_policy(
        self, ref: ClusterRef, path: str, name: str, have: dict[str, Any] | None, want: dict[str, Any] | None
    ) -> None:
        if have is not None and not controlled_by(have, ref.uid):
            if want is not None:
                raise not_ours(FAILED_CREATE, f"creating networkpolicy {name}", "NetworkPolicy")
            return  # not ours: not ours to delete either
        if want is None:
            if have is not None:
                await self.client.delete(f"{path}/{name}", uid=have["metadata"]["uid"])
        elif have is None:
            await self.create(path, want)
        elif have.get("spec") != want["spec"]:  # a PUT: a merge patch would keep stale labels
            body = {**have, "spec": want["spec"]}  # its resourceVersion: 409 if changed meanwhile
            await self.client.request("PUT", f"{path}/{name}", body=body)

    async def router(self, ref: ClusterRef, spec: InferenceClusterSpec) -> None:
        """The router's Deployment, ServiceAccount, Role and RoleBinding (spec.router), or none."""
        write = write_router(self.client, ref, spec)
        await owned_objects(write, "the router", PoolUnavailable, POOL_UNAVAILABLE)

    async def pod_groups(
        self,
        ref: ClusterRef,
        spec: InferenceClusterSpec,
        revision: str,
        pods: Iterable[dict[str, Any]],
        delete_pods: Iterable[str],
        create_groups: Iterable[int],
    ) -> None:
        """The Volcano PodGroups of spec.scheduling (pod_group_writes.py), or none."""
        write = write_pod_groups(self.client, ref, spec, revision, pods, delete_pods, create_groups)
        await owned_objects(write, "the podgroups", SchedulerUnavailable, SCHEDULER_UNAVAILABLE)

    async def model_cache(self, ref: ClusterRef, spec: InferenceClusterSpec) -> None:
        """spec.model.cache's claim (made, or the named one checked), or ours removed without one."""
        write = write_model_cache(self.client, ref, spec)
        await owned_objects(write, "the model cache's claim", ModelCacheUnavailable, MODEL_CACHE_UNAVAILABLE)


async def owned_objects(
    write: Awaitable[None], what: str, unavailable: type[Exception], unavailable_reason: str
) -> None:
    """One write_owned-based writer, its failures as the reconciler reports them: not ours, the
    API it needs not served (`unavailable`), or refused."""
    try:
        await write
    except NotOurs as exc:
        raise not_ours(FAILED_CREATE, f"creating {exc.kind.lower()} {exc.name}", exc.kind) from exc
    except unavailable as exc:
        raise WriteRefused(unavailable_reason, str(exc)) from exc
    except ApiError as exc:
        if exc.status not in (404, 409):  # gone or changed meanwhile: the next pass looks again
            raise refusal(FAILED_CREATE, f"updating {what}", exc) from exc
