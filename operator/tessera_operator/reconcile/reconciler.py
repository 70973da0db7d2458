"""One reconciliation pass for one InferenceCluster, as a recipe:

    read -> admit -> observe -> plan -> write -> report

Reads fresh state each pass (the object, its pods and Services) rather than trusting events;
decides with pure functions (the spec's rules, the pod planner, the Service and budget plans,
the scaling plan); records intent in status *before* destructive actions (so a crash mid-pass
never loses a backoff deadline); then applies the plans (`writes`).

Whatever stops a pass for good (an invalid spec, a build error, a write the API server refuses:
422, 403 from a quota) becomes a Degraded condition and a Warning Event naming the cause,
never a silent retry loop; transient errors (5xx, timeouts) raise to the work queue's backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from tessera_operator import api, builders, naming
from tessera_operator.admission.pod_dry_run import refused_pod_fields
from tessera_operator.admission.validation import capped_spec, validate_object, validate_spec
from tessera_operator.api import InferenceClusterSpec, InferenceClusterStatus
from tessera_operator.builders import ClusterRef
from tessera_operator.config import PodPolicy
from tessera_operator.fielderror import FieldError
from tessera_operator.kube import ApiError, KubeClient, core_path, custom_path
from tessera_operator.reconcile.events import Event, EventRecorder
from tessera_operator.reconcile.observe import (
    Observation,
    is_leader,
    is_orphan,
    observe,
    pod_ready,
    router_serves,
    running_revisions,
)
from tessera_operator.reconcile.owned_plans import ServicePlan, plan_services
from tessera_operator.reconcile.planner import Plan, plan
from tessera_operator.reconcile.status import build_status, degraded_status, intent_status
from tessera_operator.reconcile.writes import (
    FAILED_SCALE,
    WriteRefused,
    Writes,
    refusal,
    refused_writes,
)
from tessera_operator.scaling import autoscaler
from tessera_operator.scaling.plan import METRICS_UNAVAILABLE, ScalePlan, plan_scale, seconds_until_sample
from tessera_operator.scaling.queue_metrics import queue_depths, router_sample
from tessera_operator.timeutil import to_rfc3339

log = logging.getLogger("tessera_operator.reconcile.reconciler")
# Room for the copy in status: an object (spec and status) must stay under etcd's 1.5 MiB.
MAX_APPLIED_SPEC_BYTES = 256 * 1024


@dataclass(frozen=True)
class Read:
    """The object as this pass read it."""

    path: str
    ref: ClusterRef
    generation: int | None
    version: str | None  # its resourceVersion: the scale subresource writes only on it
    raw_spec: dict[str, Any]
    previous: InferenceClusterStatus
    now: float


@dataclass(frozen=True)
class Admission:
    """The rules' verdict: what runs when the spec is refused (capped, or the last accepted)."""

    errors: list[FieldError]
    capped: InferenceClusterSpec | None = None
    fallback: InferenceClusterSpec | None = None

    @property
    def problems(self) -> str:
        return "; ".join(str(e) for e in self.errors)


@dataclass(frozen=True)
class Seen:
    """What the cluster owns now: its pods (orphans adopted) and Services."""

    pods: list[dict[str, Any]]
    services: list[dict[str, Any]]
    # The router's Deployment has a Ready pod: only then does the client Service select the router
    # (a new router, or one turned on, must not take the leaders' traffic before it serves).
    router_ready: bool = False


@dataclass(frozen=True)
class Planned:
    spec: InferenceClusterSpec
    revision: str
    observation: Observation
    decision: Plan
    status: InferenceClusterStatus
    to_create: list[dict[str, Any]]
    services: list[ServicePlan]
    next_sample: float | None = None  # when the autoscaler samples again


@dataclass(frozen=True)
class Stop:
    """The pass ends early (its failure reported): look again after `requeue` (None: on an event)."""

    requeue: float | None


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
        self.writes = Writes(client)
        self.events = EventRecorder(client, clock)
        # By cluster: a cluster deleted and made again under its name starts a history of its own.
        self._scale_histories: dict[ClusterRef, autoscaler.History] = {}
        # The latest revision's dry-run verdict, and when it was asked (monotonic).
        self._pod_verdicts: dict[ClusterRef, tuple[str, list[FieldError], float]] = {}

    async def reconcile(self, namespace: str, name: str) -> float | None:
        """Returns when to look again (seconds), or None when the object is gone."""
        read = await self.read(namespace, name)
        if read is None:
            self._forget(namespace, name)
            return None  # gone, or being deleted: the garbage collector removes what we own
        admission = await self.admit(read)
        if isinstance(admission, Stop):
            return admission.requeue
        seen = await self.observe(read)
        planned = await self.plan(read, admission, seen)
        if isinstance(planned, Stop):
            return planned.requeue
        if not admission.errors:  # a refused spec's replicas are not what runs: no scale from them
            planned = await self.autoscale(read, planned)
        intent, refused = await self.write(read, seen, planned)
        await self.report(read, admission, planned, intent, refused)
        if refused:  # e.g. a quota that may free up, or a fixed spec: look again at the resync
            return self.resync_seconds
        # `is None`, not `or`: a requeue of 0.0 (a group to recreate at once) is a time, not "none".
        waits = [w for w in (planned.decision.requeue_after, planned.next_sample) if w is not None]
        return min([*waits, self.resync_seconds])

    # -- read ---------------------------------------------------------------------------------

    async def read(self, namespace: str, name: str) -> Read | None:
        """The object and its last status; None when it is gone or being deleted."""
        path = custom_path(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        try:
            ic = await self.client.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        meta = ic["metadata"]
        if meta.get("deletionTimestamp"):
            return None
        try:
            previous = InferenceClusterStatus.model_validate(ic.get("status") or {})
        except ValidationError as exc:
            # A status this operator cannot read (one written by a newer version): start afresh
            # rather than fail every pass with no condition to say why.
            log.warning("%s/%s: unreadable status, rebuilt from the pods: %s", namespace, name, exc)
            previous = InferenceClusterStatus()
        ref = ClusterRef(name, namespace, meta["uid"])
        generation, version = meta.get("generation"), meta.get("resourceVersion")
        return Read(path, ref, generation, version, ic.get("spec") or {}, previous, self.clock())

    # -- admit --------------------------------------------------------------------------------

    async def admit(self, read: Read) -> Admission | Stop:
        """The spec's rules and the API server's dry run of its pods. A refused spec does not
        stop the cluster: its groups run and are repaired at the cap (too many replicas alone),
        or as the last accepted spec said; with neither, the pass stops (reported)."""
        ref = read.ref
        try:  # pure: a spec the rules cannot even read is reported once, never retried in a loop
            errors = validate_object(ref.name, read.raw_spec, self.policy)
            refused_pods = [] if errors else await self.pod_verdict(ref, read.raw_spec)
            errors = errors or refused_pods
            capped = capped_spec(read.raw_spec, errors, self.policy)
            fallback = capped or (self.last_accepted(read.previous) if errors else None)
        except (TimeoutError, ApiError, OSError):
            raise  # transient: the work queue's backoff
        except Exception as exc:
            log.error("%s/%s: cannot judge the spec: %s", ref.namespace, ref.name, type(exc).__name__)
            message = f"the spec cannot be judged: {type(exc).__name__}: {str(exc)[:300]}"
            await self.report_degraded(read, read.previous, "InvalidSpec", message)
            return Stop(self.resync_seconds)
        admission = Admission(errors, capped, fallback)
        if errors and fallback is None:
            await self.report_degraded(read, read.previous, "InvalidSpec", admission.problems)
            # An edit brings a spec the rules refused back (its watch event); the API server's
            # refusal may lift by itself (a policy changed): asked again at the resync.
            return Stop(self.resync_seconds if refused_pods else None)
        return admission

    async def pod_verdict(self, ref: ClusterRef, raw_spec: dict[str, Any]) -> list[FieldError]:
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
            _, refusal_, asked = known
            if not refusal_ or tick - asked < self.resync_seconds:
                return refusal_
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
        caches: tuple[dict[ClusterRef, Any], ...] = (self._scale_histories, self._pod_verdicts)
        for cache in caches:
            for ref in [r for r in cache if (r.namespace, r.name) == (namespace, name)]:
                del cache[ref]

    # -- observe ------------------------------------------------------------------------------

    async def observe(self, read: Read) -> Seen:
        ref = read.ref
        selector = naming.selector_string(naming.cluster_selector(ref.name))
        pods, services, router = await asyncio.gather(
            self.client.list(core_path(ref.namespace, "pods"), selector),
            self.client.list(core_path(ref.namespace, "services"), selector),
            self.read_router(ref),
        )
        ready = router is not None and router_serves(router, ref.uid)
        return Seen(await self.adopt_orphans(ref, pods), list(services), ready)

    async def read_router(self, ref: ClusterRef) -> dict[str, Any] | None:
        """The router's Deployment, or None (none, or no right to read it: the leaders serve)."""
        path = custom_path("apps", "v1", ref.namespace, "deployments", naming.router_name(ref.name))
        try:
            return dict(await self.client.get(path))
        except ApiError as exc:
            if exc.status in (403, 404):
                return None
            raise

    async def adopt_orphans(self, ref: ClusterRef, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Adopts the orphans among the pods, as a ReplicaSet does (the planner then keeps, rolls or
        replaces them like its own); returns the pods with the adopted ones as they are now."""
        result = []
        for pod in pods:
            if not is_orphan(pod, ref.name):
                result.append(pod)
                continue
            name = pod["metadata"]["name"]
            try:
                adopted = await self.writes.adopt(ref, pod)
            except ApiError as exc:
                if exc.status == 403:  # a Role from before adoption (no pods/patch): left alone
                    log.warning("%s/%s: cannot adopt pod %s: %s", ref.namespace, ref.name, name, exc)
                elif exc.status not in (404, 409, 422):
                    raise
                continue  # gone or replaced meanwhile: not ours
            result.append(adopted)
            message = f"adopted pod {name}, which no controller owned (left by an orphaning delete)"
            await self.post_events(ref, [Event("Normal", "Adopted", message)])
        return result

    # -- plan ---------------------------------------------------------------------------------

    async def plan(self, read: Read, admission: Admission, seen: Seen) -> Planned | Stop:
        """Pure (async only to report its failure): an exception here is a bug or a spec the
        rules missed, never transient."""
        try:
            return self.plan_pass(read, admission, seen)
        except Exception as exc:
            log.exception("%s/%s: cannot plan", read.ref.namespace, read.ref.name)
            await self.report_degraded(read, read.previous, "ReconcileError", f"{type(exc).__name__}: {exc}")
            return Stop(self.resync_seconds)

    def plan_pass(self, read: Read, admission: Admission, seen: Seen) -> Planned:
        ref, previous = read.ref, read.previous
        spec = admission.fallback or InferenceClusterSpec.model_validate(read.raw_spec)
        revision = builders.revision_of(spec, running_revisions(seen.pods))
        observation = observe(ref.name, ref.uid, seen.pods)
        decision = plan(spec, revision, observation, {g.index: g for g in previous.groups}, read.now)
        status = build_status(
            ref.name, read.generation, spec, revision, decision, builders.endpoint_of(ref), previous, read.now
        )
        applied = previous.applied_spec if admission.errors else storable_spec(read.raw_spec)
        status = status.model_copy(update={"applied_spec": applied})
        if admission.errors:  # the object's replicas are not what runs: no scale is decided from them
            status = status.model_copy(update={"autoscaling": previous.autoscaling})
        existing = {p["metadata"]["name"] for p in seen.pods}
        to_create = [
            pod
            for index in decision.create_groups
            for pod in builders.build_group(ref, spec, revision, index)
            if pod["metadata"]["name"] not in existing
        ]
        services = plan_services(ref, seen.services, spec.router.enabled and seen.router_ready)
        return Planned(spec, revision, observation, decision, status, to_create, services)

    # -- scale (a plan step with a write of its own: spec.replicas) ----------------------------

    async def autoscale(self, read: Read, planned: Planned) -> Planned:
        """Samples the Ready leaders' queues when a sample is due and sets spec.replicas through the
        scale subresource, as the HPA would. Returns the plan with the status to write and when
        to sample next. Intervals and windows run on the monotonic clock, status times on `now`."""
        spec, ref = planned.spec, read.ref
        settings = spec.autoscaling
        if settings is None or not settings.enabled:
            self._scale_histories.pop(ref, None)
            return planned
        history = self._scale_histories.setdefault(ref, autoscaler.History())
        tick = self.monotonic()
        autoscaler.seed(history, tick, spec.replicas)
        kept = planned.status.model_copy(update={"autoscaling": read.previous.autoscaling})
        wait = seconds_until_sample(history, tick, self.autoscale_interval)
        if wait is not None:
            return replace(planned, status=kept, next_sample=wait)
        groups = sorted(planned.observation.groups.items())
        ready = {i: g.leader for i, g in groups if g.leader_ready and g.leader}
        depths = dict(zip(ready, await queue_depths(list(ready.values()), settings.metric), strict=True))
        router = await self.router_sample(ref) if settings.min_replicas == 0 else None
        try:  # pure; a bug here must cost this sample, never the pass (restarts, status)
            scale = plan_scale(settings, spec.replicas, depths, history, tick, router)
        except Exception:
            log.exception("%s/%s: cannot decide a scale from %s", ref.namespace, ref.name, depths)
            history.last_sample = tick
            return replace(planned, status=kept, next_sample=self.autoscale_interval)
        last_scale = read.previous.autoscaling.last_scale_time if read.previous.autoscaling else None
        if scale.scales:
            scaled = await self.apply_scale(read, scale)
            if scaled is None:  # changed since read: decide again on the object as it is now
                history.last_sample = None
                return replace(planned, status=kept, next_sample=0.0)
            last_scale = to_rfc3339(read.now) if scaled else last_scale
        if scale.blind_warning is not None:
            log.warning("%s/%s: %s", ref.namespace, ref.name, scale.blind_warning)
            await self.post_events(ref, [Event("Warning", METRICS_UNAVAILABLE, scale.blind_warning)])
        history.blind = scale.blind
        status = planned.status.model_copy(update={"autoscaling": scale.status(read.now, last_scale)})
        return replace(planned, status=status, next_sample=self.autoscale_interval)

    async def router_sample(self, ref: ClusterRef) -> autoscaler.RouterSample | None:
        """The router pods' series (minReplicas 0); None when none of its Ready pods answers."""
        selector = naming.selector_string(naming.router_selector(ref.name))
        try:
            pods = await self.client.list(core_path(ref.namespace, "pods"), selector)
        except ApiError as exc:
            log.info("%s/%s: cannot list the router's pods: %s", ref.namespace, ref.name, exc)
            return None
        return await router_sample([pod for pod in pods if pod_ready(pod)])

    async def apply_scale(self, read: Read, scale: ScalePlan) -> bool | None:
        """True: scaled; False: refused for good (said in a Warning); None: a conflict."""
        ref = read.ref
        verb, message = scale.event()
        try:
            await self.writes.scale(read.path, read.version, scale.decision.desired)
        except ApiError as exc:
            if exc.status == 409:
                log.info("%s/%s: replicas changed meanwhile; sampling again", ref.namespace, ref.name)
                return None
            failure = refusal(FAILED_SCALE, "setting replicas through the scale subresource", exc)
            if not isinstance(failure, WriteRefused):
                raise failure from exc
            verb, message = FAILED_SCALE, str(failure)
        log.info("%s/%s: %s: %s", ref.namespace, ref.name, verb, message)
        await self.post_events(ref, [Event("Warning" if verb == FAILED_SCALE else "Normal", verb, message)])
        return verb != FAILED_SCALE

    # -- write --------------------------------------------------------------------------------

    async def write(
        self, read: Read, seen: Seen, planned: Planned
    ) -> tuple[InferenceClusterStatus, list[WriteRefused]]:
        """Intent first, then every write at once; returns the status as written and the refusals."""
        ref, decision, previous = read.ref, planned.decision, read.previous
        intent = previous
        if decision.delete_pods or decision.create_groups:
            # Intent first: a backoff deadline, an Updating mark or a group recreated after its
            # backoff must survive a crash or a failed write mid-pass (or the next pass would
            # take the recreated group for one still backing off, and tear it down).
            intent = intent_status(planned.status, previous)
            await self.writes.status(read.path, previous, intent)
        refused: list[WriteRefused] = []
        to_create = planned.to_create
        if to_create:  # the pods mount their group's key: it exists before they do
            try:
                await self.writes.group_secret(ref, decision.create_groups)
            except WriteRefused as exc:
                refused.append(exc)
                to_create = []
        try:  # a group's PodGroup (spec.scheduling) before its pods: Volcano binds them as one
            await self.writes.pod_groups(
                ref, planned.spec, planned.revision, seen.pods, decision.delete_pods, decision.create_groups
            )
        except WriteRefused as exc:
            refused.append(exc)
            to_create = []  # held: pods no scheduler takes would sit Pending
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in seen.pods}
        leaders = {p["metadata"]["name"] for p in seen.pods if is_leader(p)}
        pods_path = core_path(ref.namespace, "pods")
        refused += await refused_writes([
            *(self.writes.create(pods_path, pod) for pod in to_create),
            self.writes.services(ref, planned.services),
            self.writes.disruption_budget(ref, planned.spec, decision.surge),
            self.writes.network_policies(ref, planned.spec),
            self.writes.router(ref, planned.spec),
            self.writes.model_cache(ref, planned.spec),
            *(
                self.writes.delete_pod(ref.namespace, pod, uids.get(pod), pod in leaders)
                for pod in decision.delete_pods
            ),
        ])  # fmt: skip
        log.debug(
            "%s/%s: %d pods seen, %d created, %d deleted, groups %s",
            ref.namespace, ref.name, len(seen.pods), len(to_create), len(decision.delete_pods),
            [(g.index, g.phase) for g in planned.status.groups],
        )  # fmt: skip
        return intent, refused

    # -- report -------------------------------------------------------------------------------

    async def report(
        self,
        read: Read,
        admission: Admission,
        planned: Planned,
        intent: InferenceClusterStatus,
        refused: list[WriteRefused],
    ) -> None:
        """The status of the pass (Degraded for a refused write or a held spec) and its Events."""
        status, ref = planned.status, read.ref
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            failed = degraded_status(
                status, read.generation, refused[0].reason, f"{refused[0]}{more}", read.now, read.previous
            )
            await self.report_failure(read, intent, failed)
        elif admission.errors:
            held_as = (
                f"holding {admission.capped.replicas} groups until it is lowered"
                if admission.capped is not None
                else f"running revision {planned.revision}, the last accepted spec, until it is fixed"
            )
            message = f"{admission.problems}; {held_as}"
            held = degraded_status(status, read.generation, "InvalidSpec", message, read.now, read.previous)
            await self.report_failure(read, intent, held)
        else:
            await self.writes.status(read.path, intent, status)
        events = planned.decision.events
        await self.post_events(ref, events)
        if events:
            log.info("%s/%s: %s", ref.namespace, ref.name, "; ".join(e.message for e in events))

    async def report_degraded(
        self, read: Read, previous: InferenceClusterStatus, reason: str, message: str
    ) -> None:
        failed = degraded_status(previous, read.generation, reason, message, read.now)
        await self.report_failure(read, previous, failed)

    async def report_failure(
        self, read: Read, previous: InferenceClusterStatus, status: InferenceClusterStatus
    ) -> None:
        """Write a Degraded status; a Warning Event when the failure changed (not one per pass)."""
        await self.writes.status(read.path, previous, status)
        degraded = next(c for c in status.conditions if c.type == "Degraded")
        before = next((c for c in previous.conditions if c.type == "Degraded"), None)
        if before is None or (before.status, before.reason, before.message) != (
            degraded.status, degraded.reason, degraded.message,
        ):  # fmt: skip
            ref = read.ref
            log.warning("%s/%s: %s: %s", ref.namespace, ref.name, degraded.reason, degraded.message)
            await self.post_events(ref, [Event("Warning", degraded.reason, degraded.message)])

    async def post_events(self, ref: ClusterRef, events: list[Event]) -> None:
        await self.events.post(ref, events)


def storable_spec(raw_spec: dict[str, Any]) -> dict[str, Any] | None:
    """The accepted spec as status keeps it; None when too large to keep beside the spec."""
    return raw_spec if len(json.dumps(raw_spec)) <= MAX_APPLIED_SPEC_BYTES else None
