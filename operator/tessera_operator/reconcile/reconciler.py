"""One reconciliation pass for one InferenceCluster: read everything, plan, write the difference.

Reads fresh state each pass (the object, its pods and Services) rather than trusting events,
records intent in status *before* destructive actions (so a crash mid-pass never loses a
backoff deadline), creates pods under stable names (a repeated create is a harmless 409) and
deletes with a uid precondition (never a newer incarnation of the same name).

Whatever stops a pass for good (an invalid spec, a build error, a write the API server refuses:
422, 403 from a quota) becomes a Degraded condition and a Warning Event naming the cause,
never a silent retry loop; transient errors (5xx, timeouts) raise to the work queue's backoff.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import ValidationError

from tessera_operator import api, builders, naming
from tessera_operator.admission.pod_dry_run import refused_pod_fields
from tessera_operator.admission.podpolicy import PodPolicy
from tessera_operator.admission.validation import capped_spec, validate_object, validate_spec
from tessera_operator.api import AutoscalingStatus, InferenceClusterSpec, InferenceClusterStatus
from tessera_operator.fielderror import FieldError
from tessera_operator.kube import RETRYABLE, ApiError, KubeClient, core_path, custom_path
from tessera_operator.reconcile.observe import (
    Observation,
    controlled_by,
    is_orphan,
    is_orphaned,
    observe,
    running_revisions,
)
from tessera_operator.reconcile.planner import Event, plan
from tessera_operator.reconcile.status import build_status, degraded_status, intent_status, merge_patch
from tessera_operator.scaling import autoscaler
from tessera_operator.scaling.queue_metrics import queue_depths
from tessera_operator.timeutil import to_rfc3339

log = logging.getLogger("tessera_operator.reconcile.reconciler")
COMPONENT = "tessera-operator"
FAILED_CREATE, FAILED_DELETE, FAILED_SCALE = "FailedCreate", "FailedDelete", "FailedScale"
EVENT_COUNTS_KEPT = 4096


class WriteRefused(Exception):
    """The API server refused a write for good (4xx other than a conflict): report it, retry at resync."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Reconciler:
    def __init__(
        self,
        client: KubeClient,
        resync_seconds: float = 30.0,
        clock: Callable[[], float] = time.time,
        policy: PodPolicy | None = None,
        autoscale_interval: float = 15.0,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self.client = client
        self.resync_seconds = resync_seconds
        self.clock = clock  # wall time: status and backoff deadlines, which outlive this process
        self.monotonic = monotonic  # the autoscaler's intervals and windows, which do not
        self.policy = policy or PodPolicy()
        self.autoscale_interval = autoscale_interval
        # By cluster: a cluster deleted and made again under its name starts a history of its own.
        self._scale_histories: dict[builders.ClusterRef, autoscaler.History] = {}
        # The latest revision's dry-run verdict, and when it was asked (monotonic).
        self._pod_verdicts: dict[builders.ClusterRef, tuple[str, list[FieldError], float]] = {}
        self._policy_version: str | None = None  # of PodDisruptionBudgets, once discovered
        # Occurrences of each Event this process posted (by name, least recent first), so a
        # repeat bumps the count; bounded like client-go's correlator cache.
        self._event_counts: dict[str, int] = {}

    async def reconcile(self, namespace: str, name: str) -> float | None:
        """Returns when to look again (seconds), or None when the object is gone."""
        ic_path = custom_path(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        try:
            ic = await self.client.get(ic_path)
        except ApiError as exc:
            if exc.status == 404:
                self._forget(namespace, name)
                return None
            raise
        meta = ic["metadata"]
        if meta.get("deletionTimestamp"):
            self._forget(namespace, name)
            return None  # the garbage collector removes what we own
        ref = builders.ClusterRef(name, namespace, meta["uid"])
        generation = meta.get("generation")
        try:
            previous = InferenceClusterStatus.model_validate(ic.get("status") or {})
        except ValidationError as exc:
            # A status this operator cannot read (one written by a newer version): start afresh
            # rather than fail every pass with no condition to say why.
            log.warning("%s/%s: unreadable status, rebuilt from the pods: %s", namespace, name, exc)
            previous = InferenceClusterStatus()
        now = self.clock()

        raw_spec = ic.get("spec") or {}
        try:  # pure: a spec the rules cannot even read is reported once, never retried in a loop
            errors = validate_object(name, raw_spec, self.policy)
            refused_pods = [] if errors else await self.pod_verdict(ref, raw_spec)
            errors = errors or refused_pods
            # A refused spec does not stop the cluster: its groups run and are repaired at the cap
            # (too many replicas alone), or as the last accepted spec said.
            capped = capped_spec(raw_spec, errors, self.policy)
            fallback = capped or (self.last_accepted(previous) if errors else None)
        except (TimeoutError, ApiError, OSError):
            raise  # transient: the work queue's backoff
        except Exception as exc:
            log.error("%s/%s: cannot judge the spec: %s", namespace, name, type(exc).__name__)
            message = f"the spec cannot be judged: {type(exc).__name__}: {str(exc)[:300]}"
            await self.report(ic_path, ref, previous, degraded_status(
                previous, generation, "InvalidSpec", message, now
            ))  # fmt: skip
            return self.resync_seconds
        problems = "; ".join(str(e) for e in errors)
        if errors and fallback is None:
            await self.report(ic_path, ref, previous, degraded_status(
                previous, generation, "InvalidSpec", problems, now
            ))  # fmt: skip
            # An edit brings a spec the rules refused back (its watch event); the API server's
            # refusal may lift by itself (a policy changed): asked again at the resync.
            return self.resync_seconds if refused_pods else None

        selector = naming.selector_string(naming.cluster_selector(name))
        pods, services = await asyncio.gather(
            self.client.list(core_path(namespace, "pods"), selector),
            self.client.list(core_path(namespace, "services"), selector),
        )
        pods = await self.adopt_orphans(ref, pods)
        try:  # pure: an exception here is a bug or a spec the rules missed, never transient
            spec = fallback or InferenceClusterSpec.model_validate(raw_spec)
            revision = builders.revision_of(spec, running_revisions(pods))
            observation = observe(name, ref.uid, pods)
            prior = {g.index: g for g in previous.groups}
            decision = plan(spec, revision, observation, prior, now)
            status = build_status(
                name, generation, spec, revision, decision, builders.endpoint_of(ref), previous, now
            )
            applied = previous.applied_spec if errors else storable_spec(raw_spec)
            status = status.model_copy(update={"applied_spec": applied})
            existing = {p["metadata"]["name"] for p in pods}
            to_create = [
                pod
                for index in decision.create_groups
                for pod in builders.build_group(ref, spec, revision, index)
                if pod["metadata"]["name"] not in existing
            ]
        except Exception as exc:
            log.exception("%s/%s: cannot plan", namespace, name)
            message = f"{type(exc).__name__}: {exc}"
            await self.report(ic_path, ref, previous, degraded_status(
                previous, generation, "ReconcileError", message, now
            ))  # fmt: skip
            return self.resync_seconds

        if errors:  # the object's replicas are not what runs: no scale is decided from them
            status, next_sample = status.model_copy(update={"autoscaling": previous.autoscaling}), None
        else:
            version = meta.get("resourceVersion")
            status, next_sample = await self.autoscale(
                ic_path, ref, spec, version, observation, previous, status, now
            )
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
        intent = previous
        if decision.delete_pods or decision.create_groups:
            # Intent first: a backoff deadline, an Updating mark or a group recreated after its
            # backoff must survive a crash or a failed write mid-pass (or the next pass would
            # take the recreated group for one still backing off, and tear it down).
            intent = intent_status(status, previous)
            await self.write_status(ic_path, previous, intent)
        refused: list[WriteRefused] = []
        if to_create:  # the pods mount their group's key: it exists before they do
            try:
                await self.ensure_group_secret(ref, decision.create_groups)
            except WriteRefused as exc:
                refused.append(exc)
                to_create = []
        writes = [
            *(self.create(core_path(namespace, "pods"), pod) for pod in to_create),
            self.ensure_services(ref, services),
            self.ensure_disruption_budget(ref, spec, decision.surge),
            self.ensure_network_policies(ref, spec),
            *(self.delete_pod(namespace, pod, uids.get(pod)) for pod in decision.delete_pods),
        ]
        refused += await self.refused_writes(writes)
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            message = f"{refused[0]}{more}"
            failed = degraded_status(status, generation, refused[0].reason, message, now, previous)
            await self.report(ic_path, ref, intent, failed)
        elif errors:
            held_as = (
                f"holding {capped.replicas} groups until it is lowered"
                if capped is not None
                else f"running revision {revision}, the last accepted spec, until it is fixed"
            )
            message = f"{problems}; {held_as}"
            held = degraded_status(status, generation, "InvalidSpec", message, now, previous)
            await self.report(ic_path, ref, intent, held)
        else:
            await self.write_status(ic_path, intent, status)
        log.debug(
            "%s/%s: %d pods seen, %d created, %d deleted, groups %s",
            namespace, name, len(pods), len(to_create), len(decision.delete_pods),
            [(g.index, g.phase) for g in status.groups],
        )  # fmt: skip
        await self.post_events(ref, decision.events)
        if decision.events:
            log.info("%s/%s: %s", namespace, name, "; ".join(e.message for e in decision.events))
        if refused:  # e.g. a quota that may free up, or a fixed spec: look again at the resync
            return self.resync_seconds
        # `is None`, not `or`: a requeue of 0.0 (a group to recreate at once) is a time, not "none".
        waits = [w for w in (decision.requeue_after, next_sample) if w is not None]
        return min([*waits, self.resync_seconds])

    async def pod_verdict(self, ref: builders.ClusterRef, raw_spec: dict[str, Any]) -> list[FieldError]:
        """The API server's dry-run verdict on the pods of a valid spec's revision: a spec whose
        pods it refuses is held like any invalid spec, its groups untouched. Pods it takes are
        taken for good (asked once per revision); a refusal is asked again after a resync."""
        try:
            spec = InferenceClusterSpec.model_validate(raw_spec)  # valid: validate_object passed it
            revision = builders.revision_of(spec)
        except Exception:  # a build error: the plan below reports it (ReconcileError)
            return []
        tick = self.monotonic()
        known = self._pod_verdicts.get(ref)
        if known is not None and known[0] == revision:
            _, refusal, asked = known
            if not refusal or tick - asked < self.resync_seconds:
                return refusal
        try:
            verdict = await refused_pod_fields(self.client, ref, spec, revision)
        except Exception:  # a build error: the plan below reports it (ReconcileError)
            return []
        if verdict is None:  # no answer: the pods' own creates will say
            return []
        self._pod_verdicts[ref] = (revision, verdict, tick)
        return verdict

    def last_accepted(self, status: InferenceClusterStatus) -> InferenceClusterSpec | None:
        """The spec recorded as accepted, if this operator (its policy now included) still accepts it."""
        if not status.applied_spec:
            return None
        try:
            spec = InferenceClusterSpec.model_validate(status.applied_spec)
        except ValidationError:
            return None
        return None if validate_spec(spec, self.policy) else spec

    def _forget(self, namespace: str, name: str) -> None:
        """Drop what this process keeps about a cluster that is gone."""
        caches: tuple[dict[builders.ClusterRef, Any], ...] = (self._scale_histories, self._pod_verdicts)
        for cache in caches:
            for ref in [r for r in cache if (r.namespace, r.name) == (namespace, name)]:
                del cache[ref]

    async def autoscale(
        self,
        ic_path: str,
        ref: builders.ClusterRef,
        spec: InferenceClusterSpec,
        version: str | None,
        observation: Observation,
        previous: InferenceClusterStatus,
        status: InferenceClusterStatus,
        now: float,
    ) -> tuple[InferenceClusterStatus, float | None]:
        """Samples the Ready leaders' queues when a sample is due and sets spec.replicas through the
        scale subresource, as the HPA would: only on the object as read (`version`), so replicas
        set meanwhile (`kubectl scale`, a GitOps sync) win. Returns the status to write and when
        to sample next. Intervals and windows run on the monotonic clock, status times on `now`."""
        settings = spec.autoscaling
        if settings is None or not settings.enabled:
            self._scale_histories.pop(ref, None)
            return status, None
        history = self._scale_histories.setdefault(ref, autoscaler.History())
        tick = self.monotonic()
        autoscaler.seed(history, tick, spec.replicas)
        kept = status.model_copy(update={"autoscaling": previous.autoscaling})
        if history.last_sample is not None and tick - history.last_sample < self.autoscale_interval:
            return kept, history.last_sample + self.autoscale_interval - tick
        ready = {i: g.leader for i, g in sorted(observation.groups.items()) if g.leader_ready and g.leader}
        leaders = list(ready.values())
        depths = dict(zip(ready, await queue_depths(leaders, settings.metric), strict=True))
        try:  # pure; a bug here must cost this sample, never the pass (restarts, status)
            sample = autoscaler.sample_of(depths, spec.replicas)
            decision = autoscaler.decide(settings, spec.replicas, sample, history, tick)
        except Exception:
            log.exception("%s/%s: cannot decide a scale from %s", ref.namespace, ref.name, depths)
            history.last_sample = tick
            return kept, self.autoscale_interval
        last_scale = previous.autoscaling.last_scale_time if previous.autoscaling else None
        if decision.desired != spec.replicas:
            verb = "ScaledUp" if decision.desired > spec.replicas else "ScaledDown"
            message = f"replicas {spec.replicas} -> {decision.desired}: {decision.reason}"
            scale = {"metadata": {"resourceVersion": version}, "spec": {"replicas": decision.desired}}
            try:
                await self.client.merge_patch(ic_path + "/scale", scale)
            except ApiError as exc:
                if exc.status == 409:  # changed since read: decide again on the object as it is now
                    log.info("%s/%s: replicas changed meanwhile; sampling again", ref.namespace, ref.name)
                    history.last_sample = None
                    return kept, 0.0
                failure = refusal(FAILED_SCALE, "setting replicas through the scale subresource", exc)
                if not isinstance(failure, WriteRefused):
                    raise failure from exc
                verb, message = FAILED_SCALE, str(failure)
            else:
                last_scale = to_rfc3339(now)
            log.info("%s/%s: %s: %s", ref.namespace, ref.name, verb, message)
            await self.post_events(
                ref, [Event("Warning" if verb == FAILED_SCALE else "Normal", verb, message)]
            )
        blind = bool(leaders) and sample.measured == 0
        if blind and not history.blind:
            # Said once when it starts: a NetworkPolicy or a port the operator cannot reach would
            # otherwise leave the cluster at its size forever with nothing but a 0 in status.
            message = (
                f"none of {len(leaders)} Ready leaders answered {settings.metric} on /metrics: "
                "not scaling (can the operator reach the leaders' http port?)"
            )
            log.warning("%s/%s: %s", ref.namespace, ref.name, message)
            await self.post_events(ref, [Event("Warning", "MetricsUnavailable", message)])
        history.blind = blind
        measured = AutoscalingStatus(
            queue_depth=sample.waiting if sample.measured else None,
            measured_replicas=sample.measured,
            desired_replicas=decision.desired,
            last_sample_time=to_rfc3339(now),
            last_scale_time=last_scale,
        )
        return status.model_copy(update={"autoscaling": measured}), self.autoscale_interval

    async def adopt_orphans(
        self, ref: builders.ClusterRef, pods: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Adopts the orphans among the pods, as a ReplicaSet does (the planner then keeps, rolls or
        replaces them like its own); returns the pods with the adopted ones as they are now."""
        result = []
        for pod in pods:
            if not is_orphan(pod, ref.name):
                result.append(pod)
                continue
            meta = pod["metadata"]
            path = core_path(ref.namespace, "pods", meta["name"])
            try:
                adopted = await self.client.merge_patch(path, adoption(pod, ref))
            except ApiError as exc:
                if exc.status == 403:  # a Role from before adoption (no pods/patch): left alone
                    log.warning("%s/%s: cannot adopt pod %s: %s", ref.namespace, ref.name, meta["name"], exc)
                elif exc.status not in (404, 409, 422):
                    raise
                continue  # gone or replaced meanwhile: not ours
            result.append(adopted)
            message = f"adopted pod {meta['name']}, which no controller owned (left by an orphaning delete)"
            await self.post_events(ref, [Event("Normal", "Adopted", message)])
        return result

    async def refused_writes(self, writes: list[Any]) -> list[WriteRefused]:
        """Runs the writes; returns those refused for good, raises anything transient."""
        results = await asyncio.gather(*writes, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, WriteRefused):
                raise result
        return [r for r in results if isinstance(r, WriteRefused)]

    async def report(
        self,
        ic_path: str,
        ref: builders.ClusterRef,
        previous: InferenceClusterStatus,
        status: InferenceClusterStatus,
    ) -> None:
        """Write a Degraded status; a Warning Event when the failure changed (not one per pass)."""
        await self.write_status(ic_path, previous, status)
        degraded = next(c for c in status.conditions if c.type == "Degraded")
        before = next((c for c in previous.conditions if c.type == "Degraded"), None)
        if before is None or (before.status, before.reason, before.message) != (
            degraded.status, degraded.reason, degraded.message,
        ):  # fmt: skip
            log.warning("%s/%s: %s: %s", ref.namespace, ref.name, degraded.reason, degraded.message)
            await self.post_events(ref, [Event("Warning", degraded.reason, degraded.message)])

    async def write_status(
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

    async def delete_pod(self, namespace: str, name: str, uid: str | None) -> None:
        try:
            await self.client.delete(core_path(namespace, "pods", name), uid=uid)
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone already, or replaced by a newer incarnation
                raise refusal(FAILED_DELETE, f"deleting pod {name}", exc) from exc

    async def ensure_services(self, ref: builders.ClusterRef, services: Iterable[dict[str, Any]]) -> None:
        existing = {s["metadata"]["name"]: s for s in services}
        for desired in (builders.build_headless_service(ref), builders.build_client_service(ref)):
            name = desired["metadata"]["name"]
            current = existing.get(name)
            path = core_path(ref.namespace, "services")
            if current is None:
                if not await self.create(path, desired):  # it exists, yet without our labels
                    await self.check_service_is_ours(ref, name)
                continue
            orphaned = is_orphaned(current, ref.name)
            if not orphaned and not controlled_by(current, ref.uid):
                raise not_ours(
                    FAILED_CREATE, f"creating service {name}", "Service"
                )  # our labels, another owner
            if orphaned or service_drifted(current, desired):  # an orphan is adopted as it is repaired
                try:
                    await self.repair_service(ref, current, desired)
                except ApiError as exc:
                    if exc.status not in (404, 409):  # gone or changed meanwhile: look again next pass
                        raise refusal(FAILED_CREATE, f"repairing service {name}", exc) from exc

    async def check_service_is_ours(self, ref: builders.ClusterRef, name: str) -> None:
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

    async def repair_service(
        self, ref: builders.ClusterRef, current: dict[str, Any], desired: dict[str, Any]
    ) -> None:
        name = desired["metadata"]["name"]
        if desired["spec"].get("clusterIP") == "None" and current["spec"].get("clusterIP") != "None":
            await self.client.delete(
                core_path(ref.namespace, "services", name), uid=current["metadata"]["uid"]
            )
            await self.create(core_path(ref.namespace, "services"), desired)  # clusterIP is immutable
            return
        fixed = dict(current)
        fixed["spec"] = {**current["spec"], **desired["spec"]}
        fixed["metadata"] = {**current["metadata"], "ownerReferences": desired["metadata"]["ownerReferences"]}
        await self.client.request("PUT", core_path(ref.namespace, "services", name), body=fixed)

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

    async def ensure_disruption_budget(
        self, ref: builders.ClusterRef, spec: InferenceClusterSpec, surge_groups: int
    ) -> None:
        version = await self.policy_version()
        path = custom_path("policy", version, ref.namespace, "poddisruptionbudgets")
        desired = builders.build_disruption_budget(ref, spec, f"policy/{version}", surge_groups)
        current = await self.read_owned(f"{path}/{ref.name}", f"poddisruptionbudget {ref.name}")
        orphaned = current is not None and is_orphaned(current, ref.name)
        if current is not None and not orphaned and not controlled_by(current, ref.uid):
            if desired is None:
                return  # none wanted (opted out, or one group): another's budget is theirs to keep
            what = f"updating poddisruptionbudget {ref.name}"
            raise not_ours(FAILED_CREATE, what, "PodDisruptionBudget")  # it would guard our pods wrongly
        try:
            if desired is None:
                if current is not None:
                    await self.client.delete(f"{path}/{ref.name}", uid=current["metadata"]["uid"])
            elif current is None:
                await self.create(path, desired)
            elif orphaned:  # left by an orphaning delete: adopted, with this cluster's budget
                body = {**adoption(current, ref), "spec": desired["spec"]}
                await self.client.merge_patch(f"{path}/{ref.name}", body)
            elif budget_drifted(current["spec"], desired["spec"]):
                await self.client.merge_patch(f"{path}/{ref.name}", {"spec": desired["spec"]})
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone or changed meanwhile: the next pass looks again
                raise refusal(FAILED_CREATE, f"updating poddisruptionbudget {ref.name}", exc) from exc

    async def ensure_group_secret(self, ref: builders.ClusterRef, groups: Iterable[int]) -> None:
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
        data = current.get("data") or {}
        missing = builders.missing_group_keys(data, groups)
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

    async def ensure_network_policies(self, ref: builders.ClusterRef, spec: InferenceClusterSpec) -> None:
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
        names = set(naming.network_policy_names(ref.name))
        try:
            for name in sorted(names):
                have, want = current.get(name), desired.get(name)
                if have is not None and not controlled_by(have, ref.uid):
                    if want is not None:
                        raise not_ours(FAILED_CREATE, f"creating networkpolicy {name}", "NetworkPolicy")
                    continue  # not ours: not ours to delete either
                if want is None:
                    if have is not None:
                        await self.client.delete(f"{path}/{name}", uid=have["metadata"]["uid"])
                elif have is None:
                    await self.create(path, want)
                elif have.get("spec") != want["spec"]:  # a PUT: a merge patch would keep stale labels
                    body = {**have, "spec": want["spec"]}  # its resourceVersion: 409 if changed meanwhile
                    await self.client.request("PUT", f"{path}/{name}", body=body)
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone or changed meanwhile: the next pass looks again
                raise refusal(FAILED_CREATE, "updating networkpolicies", exc) from exc

    async def post_events(self, ref: builders.ClusterRef, events: list[Event]) -> None:
        """One Event object per (object, type, reason, message), as client-go's correlator keeps
        them: a repeat, or a POST retried after a lost answer, bumps its count instead of
        adding another object."""
        now = to_rfc3339(self.clock())
        path = core_path(ref.namespace, "events")
        for event in events:
            name = event_name(ref, event)
            body = {
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
            try:
                await self._create_or_count(path, name, body, now)
            except ApiError as exc:  # events are best effort: never fail a pass over one
                log.warning("could not post event %s: %s", event.reason, exc)

    async def _create_or_count(self, path: str, name: str, body: dict[str, Any], now: str) -> None:
        try:
            await self.client.create(path, body)
            count = 1
        except ApiError as exc:
            if exc.status != 409:
                raise
            count = self._event_counts.pop(name, 1) + 1
            await self.client.merge_patch(f"{path}/{name}", {"count": count, "lastTimestamp": now})
        self._event_counts[name] = count  # re-inserted last: the oldest entries go first
        if len(self._event_counts) > EVENT_COUNTS_KEPT:
            del self._event_counts[next(iter(self._event_counts))]


def event_name(ref: builders.ClusterRef, event: Event) -> str:
    """A stable name for one kind of Event about one object (the same inputs, the same name)."""
    digest = hashlib.sha256(f"{ref.uid}\0{event.type}\0{event.reason}\0{event.message}".encode()).hexdigest()
    return f"{ref.name}.{digest[:16]}"


def refusal(reason: str, what: str, exc: ApiError) -> Exception:
    """A WriteRefused naming the object and the API server's message, or `exc` itself if transient."""
    if exc.status in RETRYABLE or exc.status < 400:
        return exc
    return WriteRefused(reason, f"{what}: {exc}")


def adoption(orphan: dict[str, Any], ref: builders.ClusterRef) -> dict[str, Any]:
    """The merge patch that makes the cluster an orphan's controller; its uid makes it this very
    object, not one made again under its name meanwhile."""
    meta = orphan["metadata"]
    owners = [*(meta.get("ownerReferences") or []), builders.owner_reference(ref)]
    return {"metadata": {"uid": meta["uid"], "ownerReferences": owners}}


def not_ours(reason: str, what: str, kind: str) -> WriteRefused:
    return WriteRefused(
        reason, f"{what}: a {kind} of that name exists and is not this cluster's; rename or delete it"
    )


# Room for the copy in status: an object (spec and status) must stay under etcd's 1.5 MiB.
MAX_APPLIED_SPEC_BYTES = 256 * 1024


def storable_spec(raw_spec: dict[str, Any]) -> dict[str, Any] | None:
    """The accepted spec as status keeps it; None when too large to keep beside the spec."""
    return raw_spec if len(json.dumps(raw_spec)) <= MAX_APPLIED_SPEC_BYTES else None


def budget_drifted(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether a budget's spec differs from ours in what the API server keeps: one that drops a
    field it does not know (unhealthyPodEvictionPolicy before 1.27) must not be patched each pass."""
    return any(
        current.get(key) != value
        for key, value in desired.items()
        if key in ("minAvailable", "selector") or key in current
    )


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
