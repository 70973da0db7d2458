"""The status the operator reports: counts, per-group state and Ready / Progressing / Degraded.

Ready counts only groups whose *leader* passes its readiness probe (rendezvous and a warm-up
forward pass done): pods merely Running never make a cluster Ready.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tessera_operator import naming
from tessera_operator.api import Condition, GroupStatus, InferenceClusterSpec, InferenceClusterStatus
from tessera_operator.reconcile.planner import Plan
from tessera_operator.timeutil import from_rfc3339, to_rfc3339


def set_condition(conditions: list[Condition], new: Condition, now: float) -> list[Condition]:
    """Replace the condition of the same type; keep its transition time when the status is unchanged."""
    old = next((c for c in conditions if c.type == new.type), None)
    kept = old.last_transition_time if old is not None and old.status == new.status else None
    # The CRD's default status has a condition without a time: it gets one at its first pass.
    transition = kept or to_rfc3339(now)
    updated = new.model_copy(update={"last_transition_time": transition})
    return [c for c in conditions if c.type != new.type] + [updated]


def _ready(spec: InferenceClusterSpec, ready: int) -> Condition:
    replicas = spec.replicas
    if replicas == 0:
        return Condition(type="Ready", status="False", reason="ScaledToZero", message="replicas is 0")
    if ready >= replicas:
        return Condition(
            type="Ready", status="True", reason="GroupsReady", message=f"{ready}/{replicas} groups ready"
        )
    return Condition(
        type="Ready", status="False", reason="GroupsNotReady", message=f"{ready}/{replicas} groups ready"
    )


def _progressing(spec: InferenceClusterSpec, plan: Plan, updated_ready: int, updated: int) -> Condition:
    replicas = spec.replicas
    if plan.outdated or plan.surge:
        return Condition(
            type="Progressing",
            status="True",
            reason="RollingUpdate",
            message=f"{updated}/{replicas} groups updated, {plan.outdated} outdated, {plan.surge} surge",
        )
    extra = len([g for g in plan.groups if g.index >= replicas])
    if updated_ready < replicas or extra:
        return Condition(
            type="Progressing",
            status="True",
            reason="GroupsStarting",
            message=f"{updated_ready}/{replicas} groups ready at the current revision",
        )
    return Condition(
        type="Progressing", status="False", reason="Complete", message=f"{replicas} groups ready and updated"
    )


def _degraded(groups: list[GroupStatus], now: float, deadline: float) -> Condition:
    def late(since: str | None) -> bool:
        return now - (from_rfc3339(since) or now) >= deadline

    failing = [g for g in groups if g.phase == "BackingOff"]
    if failing:
        message = "; ".join(
            f"group {g.index}: {g.last_failure}; restart {g.restarts} at {g.next_restart_time}"
            for g in failing
        )
        # A crash loop (a mistyped model source, too little memory) waits for a person too.
        crash_looping = any(late(g.failing_since) for g in failing)
        if crash_looping:
            message += f" (failing for more than the {deadline:g} s progress deadline)"
        reason = "ProgressDeadlineExceeded" if crash_looping else "GroupRestarting"
        return Condition(type="Degraded", status="True", reason=reason, message=message)
    stuck = [g for g in groups if g.start_problem]
    if stuck:
        late_ones = [g for g in stuck if late(g.start_problem_since)]
        message = "; ".join(f"group {g.index}: {g.start_problem}" for g in stuck)
        if late_ones:
            message += f" (for more than the {deadline:g} s progress deadline)"
        reason = "ProgressDeadlineExceeded" if late_ones else "PodsNotStarting"
        return Condition(type="Degraded", status="True", reason=reason, message=message)
    return Condition(type="Degraded", status="False", reason="AsExpected", message="no group is failing")


# Degraded reasons that no amount of waiting fixes: a person must change the spec or the cluster.
STALLED_REASONS = frozenset(
    {
        "InvalidSpec",
        "ReconcileError",
        "FailedCreate",
        "FailedDelete",
        "FailedScale",
        "ProgressDeadlineExceeded",
        "ModelCacheUnavailable",  # spec.model.cache names a class or claim that is not there
    }
)


def with_kstatus(conditions: list[Condition], generation: int | None, now: float) -> list[Condition]:
    """Adds kstatus' abnormal-true conditions, the only ones GitOps tools (Flux's health checks, kpt,
    cli-utils) read on a custom resource: Stalled while a person must act (the Degraded reasons
    above), else Reconciling while the cluster moves toward its spec (Progressing, or not Ready)."""
    by_type = {c.type: c for c in conditions}
    degraded, ready, progressing = by_type.get("Degraded"), by_type.get("Ready"), by_type.get("Progressing")
    stalled = (
        degraded if degraded and degraded.status == "True" and degraded.reason in STALLED_REASONS else None
    )
    moving = None
    if stalled is None:
        if progressing and progressing.status == "True":
            moving = progressing
        elif ready and ready.status != "True" and ready.reason != "ScaledToZero":
            moving = ready
    # Never an empty message: Kubernetes 1.20 turns "" into null and refuses the status write.
    for kind, cause, calm in (
        ("Stalled", stalled, "nothing waits for a person"),
        ("Reconciling", moving, "the cluster matches its spec"),
    ):
        condition = Condition(
            type=kind,  # type: ignore[arg-type]
            status="True" if cause else "False",
            reason=cause.reason if cause else "AsExpected",
            message=(cause.message or cause.reason) if cause else calm,
            observed_generation=generation,
        )
        conditions = set_condition(conditions, condition, now)
    return conditions


def build_status(
    cluster: str,
    generation: int | None,
    spec: InferenceClusterSpec,
    revision: str,
    plan: Plan,
    endpoint: str,
    previous: InferenceClusterStatus,
    now: float,
) -> InferenceClusterStatus:
    groups = sorted(plan.groups, key=lambda g: g.index)
    live = [g for g in groups if g.pods > 0 or g.phase in ("Pending", "Starting", "Ready", "Updating")]
    ready = [g for g in groups if g.ready]
    updated = [
        g for g in groups if g.index < spec.replicas and g.revision == revision and g.phase != "Updating"
    ]
    updated_ready = [g for g in updated if g.ready]
    revisions = Counter(g.revision for g in groups if g.revision)
    current = (
        revision
        if len(updated_ready) >= spec.replicas
        else (revisions.most_common(1) or [(revision, 0)])[0][0]
    )
    conditions = list(previous.conditions)
    for condition in (
        _ready(spec, len(ready)),
        _progressing(spec, plan, len(updated_ready), len(updated)),
        _degraded(groups, now, spec.rollout.progress_deadline_seconds),
    ):
        conditions = set_condition(
            conditions, condition.model_copy(update={"observed_generation": generation}), now
        )
    conditions = with_kstatus(conditions, generation, now)
    return InferenceClusterStatus(
        observed_generation=generation,
        replicas=len(live),
        ready_replicas=len(ready),
        updated_replicas=len(updated),
        selector=naming.selector_string(naming.leader_selector(cluster)),
        current_revision=current,
        update_revision=revision,
        endpoint=endpoint,
        groups=groups,
        conditions=conditions,
    )


# Degraded and the kstatus conditions derived from it.
FAILURE_CONDITIONS = frozenset({"Degraded", "Stalled", "Reconciling"})


def _with_previous_failure(
    status: InferenceClusterStatus, previous: InferenceClusterStatus | None
) -> list[Condition]:
    """`status`'s conditions with Degraded, Stalled and Reconciling as `previous` had them."""
    if previous is None:
        return list(status.conditions)
    kept = [c for c in previous.conditions if c.type in FAILURE_CONDITIONS]
    kept_types = {c.type for c in kept}
    return [c for c in status.conditions if c.type not in kept_types] + kept


def degraded_status(
    status: InferenceClusterStatus,
    generation: int | None,
    reason: str,
    message: str,
    now: float,
    previous: InferenceClusterStatus | None = None,
) -> InferenceClusterStatus:
    """`status` with Degraded=True saying why the operator cannot act (InvalidSpec, FailedCreate, ...).

    Judged against `previous` (the status at the start of the pass): a failure reported again
    keeps its transition times, so a pass that meets the same refusal writes nothing (a write
    would echo back as a watch event and start the next pass at once).
    """
    condition = Condition(
        type="Degraded", status="True", reason=reason, message=message, observed_generation=generation
    )
    conditions = set_condition(_with_previous_failure(status, previous), condition, now)
    return status.model_copy(
        update={"observed_generation": generation, "conditions": with_kstatus(conditions, generation, now)}
    )


def intent_status(status: InferenceClusterStatus, previous: InferenceClusterStatus) -> InferenceClusterStatus:
    """What a pass writes before its pod writes: `status`'s groups (backoff deadlines, Updating
    marks, groups recreated after their backoff must survive a crash or a failed write mid-pass)
    with `previous`'s conditions and observedGeneration, which the end of the pass decides.

    Written early, a condition could flap: Degraded cleared, then set again by a refused write
    with its old transition time, and kstatus readers would see a generation observed too soon.
    """
    return status.model_copy(
        update={"conditions": list(previous.conditions), "observed_generation": previous.observed_generation}
    )


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns old into new: null deletes a key, at any depth
    (a nested field left out of new, e.g. autoscaling.queueDepth, would otherwise stay)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            inner = merge_patch(before, value)
            if inner:
                patch[key] = inner
        elif key not in old or value != before:
            patch[key] = value
    return patch
