"""One reconciliation decision, pure: (spec, revision, observed pods, last status, now) -> a Plan.

Level-based: the plan depends only on what exists now and on the group state stored in the
object's status (restart counts, backoff deadlines, groups being replaced), never on which
event woke the operator. Running it twice on the same inputs gives the same plan, so an
operator restart creates no duplicates and repairs whatever drifted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera_operator.api import GroupStatus, InferenceClusterSpec
from tessera_operator.reconcile.events import Event
from tessera_operator.reconcile.observe import GroupObservation, Observation, is_disruption
from tessera_operator.reconcile.restart import (
    record_disruption,
    record_failure,
    seconds_until_restart,
    settled,
)
from tessera_operator.reconcile.rollout import GroupState, choose_replacements, surge_count
from tessera_operator.timeutil import from_rfc3339, to_rfc3339

WAIT_FOR_DELETION_SECONDS = 1.0
# Past its grace period by this much, a pod still Terminating is most likely on a node that is
# gone: it stays until the node returns or someone force-deletes it, and its group must wait
# (the replacement takes the same name, as a StatefulSet's does). Say so, and look less often.
STUCK_TERMINATING_SECONDS = 60.0
WAIT_FOR_STUCK_SECONDS = 15.0


@dataclass
class Plan:
    create_groups: list[int] = field(default_factory=list)  # create this group's missing pods
    delete_pods: list[str] = field(default_factory=list)
    groups: list[GroupStatus] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    surge: int = 0
    outdated: int = 0

    def requeue(self, seconds: float) -> None:
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def _state(index: int, obs: GroupObservation | None, revision: str, prior: GroupStatus | None) -> GroupState:
    exists = obs is not None and bool(obs.pods)
    updated = not exists or (obs is not None and obs.revision == revision)
    ready = exists and obs is not None and obs.complete and obs.leader_ready and obs.failure() is None
    if prior is not None and prior.phase in ("BackingOff", "Updating"):
        ready = False
    return GroupState(index=index, exists=exists, updated=updated, ready=ready)


def plan(
    spec: InferenceClusterSpec,
    revision: str,
    observation: Observation,
    prior: dict[int, GroupStatus],
    now: float,
) -> Plan:
    # Strays are pods this cluster controls (observe.py ignores any other pod carrying its label).
    result = Plan(delete_pods=list(observation.strays))
    replicas = spec.replicas
    groups = observation.groups

    ordinal = [_state(i, groups.get(i), revision, prior.get(i)) for i in range(replicas)]
    # Only groups made as surge groups carry a rollout's load; one left above replicas by a
    # scale-down is removed, or it would hold on to the capacity a pending group waits for.
    existing_surge = [
        i for i, g in groups.items() if i >= replicas and g.pods and _made_as_surge(prior.get(i))
    ]
    result.surge = surge_count(replicas, spec.rollout.max_surge, ordinal, bool(existing_surge))
    desired = set(range(replicas + result.surge))
    surge = [
        _state(i, groups.get(i), revision, prior.get(i)) for i in range(replicas, replicas + result.surge)
    ]
    replacements = set(choose_replacements(replicas, spec.rollout.max_unavailable, ordinal, surge))
    result.outdated = sum(1 for g in ordinal if g.exists and not g.updated)

    for index in sorted(desired | set(groups) | set(prior)):
        obs = groups.get(index) or GroupObservation(index)
        if index not in desired:
            if obs.pods:
                result.delete_pods += sorted(obs.pods)
                kind = "surge group" if index < replicas + spec.rollout.max_surge else "group"
                result.events.append(Event("Normal", "GroupRemoved", f"removing {kind} {index}"))
            continue
        status = prior.get(index) or GroupStatus(index=index, revision=revision)
        deleting = len(result.delete_pods)
        planned = _plan_group(spec, revision, obs, status, index in replacements, now, result)
        made_now = index in result.create_groups and not obs.pods
        # Seen whole since it was last made: from then on, a missing pod was taken away.
        taken_down = len(result.delete_pods) > deleting or made_now
        whole = None if taken_down else (True if obs.complete else status.complete)
        planned = planned.model_copy(update={"complete": whole})
        as_surge = index >= replicas and (made_now or _made_as_surge(status))
        planned = planned.model_copy(update={"surge": True if as_surge else None})
        result.groups.append(_with_start_problem(spec, obs, planned, now, result))
    return result


def _made_as_surge(status: GroupStatus | None) -> bool:
    return status is not None and bool(status.surge)


def _with_start_problem(
    spec: InferenceClusterSpec, obs: GroupObservation, status: GroupStatus, now: float, result: Plan
) -> GroupStatus:
    """Records why the group's pods do not start, since when (its deadline makes the cluster
    Stalled), and says so once in a Warning Event."""
    problem = obs.start_problem() if status.phase in ("Pending", "Starting", "Updating") else None
    announced = False
    if problem is None and stuck_terminating(obs, now):
        # A node that died takes its pods into Terminating for good: the group waits for a person
        # (await_deletion's PodsStuckTerminating Event says how to help it).
        names = ", ".join(sorted(obs.terminating))
        problem, announced = f"waiting for {names} to terminate, past the grace period", True
    if problem is None:
        return status.model_copy(update={"start_problem": None, "start_problem_since": None})
    since = from_rfc3339(status.start_problem_since) if status.start_problem else None
    if since is None:
        since = now
        if not announced:
            result.events.append(Event("Warning", "PodsNotStarting", f"group {obs.index}: {problem}"))
    left = since + spec.rollout.progress_deadline_seconds - now
    if left > 0:
        result.requeue(left)  # to report the deadline when it passes
    return status.model_copy(update={"start_problem": problem, "start_problem_since": to_rfc3339(since)})


def _plan_group(
    spec: InferenceClusterSpec,
    revision: str,
    obs: GroupObservation,
    status: GroupStatus,
    replace: bool,
    now: float,
    result: Plan,
) -> GroupStatus:
    """The group's status after this pass, its pods' fate recorded in `result`: the first case
    that applies decides (backing off, being replaced, failed, incomplete), else it runs."""
    if status.phase == "BackingOff":
        return _backing_off(spec, revision, obs, status, now, result)
    replaced = _replacing(revision, obs, status, replace, now, result)
    if replaced is not None:
        return replaced
    failed = _failed(spec, obs, status, now, result)
    if failed is not None:
        return failed
    incomplete = _incomplete(revision, obs, status, now, result)
    return incomplete if incomplete is not None else _running(spec, revision, obs, status, now)


def _backing_off(
    spec: InferenceClusterSpec,
    revision: str,
    obs: GroupObservation,
    status: GroupStatus,
    now: float,
    result: Plan,
) -> GroupStatus:
    """A failed group waits out its backoff with no pods, then is made again."""
    index = obs.index
    if status.revision != revision:
        # The spec changed while the group waited out a crash backoff (a fix, or a rollback):
        # the new revision starts now, with none of the old one's failure history.
        status = status.model_copy(
            update={
                "restarts": 0,
                "failing_since": None,
                "backoff_seconds": 0.0,
                "next_restart_time": to_rfc3339(now),
            }
        )
    wait = seconds_until_restart(status, now)
    if wait > 0 or obs.pods or obs.terminating:
        result.delete_pods += sorted(obs.pods)
        if wait > 0:
            result.requeue(wait)
        else:
            await_deletion(obs, now, result)
        return status.model_copy(update={"pods": len(obs.pods), "ready": False})
    result.create_groups.append(index)
    why = (
        f"after {status.backoff_seconds:g}s backoff (restart {status.restarts})"
        if status.restarts
        else f"at revision {revision}, without the backoff of the one before"
    )
    result.events.append(Event("Normal", "GroupRestarted", f"recreating group {index} {why}"))
    size = spec.pods_per_group  # `pods` counts what exists after this pass
    return status.model_copy(
        update={"phase": "Pending", "revision": revision, "pods": size, "next_restart_time": None}
    )


def _replacing(
    revision: str, obs: GroupObservation, status: GroupStatus, replace: bool, now: float, result: Plan
) -> GroupStatus | None:
    """A group the rollout replaces (or one it was replacing): old pods go, then new ones come."""
    if not (replace or (status.phase == "Updating" and obs.revision != revision)):
        return None
    if obs.pods and obs.revision != revision:
        result.delete_pods += sorted(obs.pods)
        if replace and status.phase != "Updating":
            message = f"replacing group {obs.index}: revision {obs.revision} -> {revision}"
            result.events.append(Event("Normal", "GroupUpdating", message))
        return status.model_copy(update={"phase": "Updating", "pods": len(obs.pods), "ready": False})
    if obs.pods:
        return None  # made at the revision already: judged like any other group
    if not obs.terminating:
        result.create_groups.append(obs.index)
    else:
        await_deletion(obs, now, result)
    return status.model_copy(
        update={
            "phase": "Updating",
            "revision": revision,
            "pods": 0,
            "ready": False,
            "ready_since": None,
            "failing_since": None,  # a new revision gets its own deadline
        }
    )


def _failed(
    spec: InferenceClusterSpec, obs: GroupObservation, status: GroupStatus, now: float, result: Plan
) -> GroupStatus | None:
    """A failed group is torn down: at once after a disruption from outside, else after a backoff."""
    # Only a group once seen whole lost pods when some are missing; one still being created
    # waits for them (a quota refusing a rank is reported, not a restart storm).
    failure = obs.failure(was_complete=bool(status.complete))
    if failure is None:
        return None
    index = obs.index
    result.delete_pods += sorted(obs.pods)
    if is_disruption(failure):
        disrupted = record_disruption(status, failure, now)
        result.requeue(0.0)
        message = f"group {index} lost a rank from outside ({failure}); recreating it now, without backoff"
        result.events.append(Event("Normal", "GroupDisrupted", message))
        return disrupted.model_copy(update={"pods": len(obs.pods)})
    failed = record_failure(status, failure, now, spec.restart_policy)
    result.requeue(failed.backoff_seconds or 0.0)
    message = f"group {index} failed ({failure}); restart {failed.restarts} in {failed.backoff_seconds:g}s"
    result.events.append(Event("Warning", "GroupFailed", message))
    return failed.model_copy(update={"pods": len(obs.pods)})


def _incomplete(
    revision: str, obs: GroupObservation, status: GroupStatus, now: float, result: Plan
) -> GroupStatus | None:
    """A group of mixed revisions starts over; one missing pods gets them (at its own revision)."""
    if obs.pods and obs.revision is None:
        # Mixed revisions inside one group can never rendezvous: start it over at the current one.
        result.delete_pods += sorted(obs.pods)
        return status.model_copy(update={"phase": "Updating", "pods": len(obs.pods), "ready": False})
    if obs.complete:
        return None
    if obs.pods and obs.revision != revision:
        result.delete_pods += sorted(obs.pods)  # a partial group of an old revision: recreate it
        return status.model_copy(update={"phase": "Updating", "pods": len(obs.pods), "ready": False})
    result.create_groups.append(obs.index)
    if obs.terminating:
        await_deletion(obs, now, result)
    return status.model_copy(
        update={
            "phase": "Pending",
            "revision": revision,
            "pods": len(obs.pods),
            "ready": False,
            "ready_since": None,
        }
    )


def _running(
    spec: InferenceClusterSpec, revision: str, obs: GroupObservation, status: GroupStatus, now: float
) -> GroupStatus:
    """A whole group: Ready once its leader is, Starting while its pods run, else Pending."""
    ready = obs.leader_ready
    phase = "Ready" if ready else ("Starting" if obs.all_running else "Pending")
    ready_since = (status.ready_since or to_rfc3339(now)) if ready else None
    if ready:
        status = settled(status, now, spec.restart_policy)
    return status.model_copy(
        update={
            "phase": phase,
            "revision": obs.revision or revision,
            "pods": len(obs.pods),
            "ready": ready,
            "ready_since": ready_since,
            "next_restart_time": None,
            "failing_since": None if ready else status.failing_since,
        }
    )


def stuck_terminating(obs: GroupObservation, now: float) -> bool:
    """Some of the group's pods outlived their grace period while terminating."""
    deadline = obs.terminating_deadline
    return deadline is not None and now - deadline >= STUCK_TERMINATING_SECONDS


def await_deletion(obs: GroupObservation, now: float, result: Plan) -> None:
    """Look again soon for the group's terminating pods; warn when they outlive their grace period."""
    if not stuck_terminating(obs, now):
        result.requeue(WAIT_FOR_DELETION_SECONDS)
        return
    result.requeue(WAIT_FOR_STUCK_SECONDS)
    names = ", ".join(sorted(obs.terminating))
    result.events.append(
        Event(
            "Warning",
            "PodsStuckTerminating",
            f"group {obs.index} waits for {names} to terminate, past its grace period: a pod on an "
            "unreachable node stays until the node is back or the pod is force-deleted "
            "(kubectl delete pod NAME --grace-period=0 --force)",
        )
    )
