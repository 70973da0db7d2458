"""Whole-group restart with exponential backoff per group (never a restart storm).

A group that failed is torn down at once and recreated no earlier than `nextRestartTime`;
the delay doubles with each consecutive failure up to `backoffMaxSeconds`, and starts from
the base again once the group has stayed Ready for `resetAfterSeconds`. All of it lives in
the object's status, so an operator restart neither forgets a backoff nor restarts early.
"""

from __future__ import annotations

from tessera_operator.api import GroupStatus, RestartPolicySpec
from tessera_operator.timeutil import capped_backoff, from_rfc3339, to_rfc3339


def backoff_seconds(restarts: int, policy: RestartPolicySpec) -> float:
    """Delay before restart number `restarts` (1-based)."""
    return capped_backoff(restarts, policy.backoff_base_seconds, policy.backoff_max_seconds)


def record_failure(group: GroupStatus, reason: str, now: float, policy: RestartPolicySpec) -> GroupStatus:
    # A group that ran well for long enough: this failure is not part of a crash loop.
    restarts = settled(group, now, policy).restarts + 1
    delay = backoff_seconds(restarts, policy)
    return group.model_copy(
        update={
            "phase": "BackingOff",
            "ready": False,
            "restarts": restarts,
            "last_failure": reason,
            "last_failure_time": to_rfc3339(now),
            "backoff_seconds": delay,
            "next_restart_time": to_rfc3339(now + delay),
            "ready_since": None,
            "failing_since": group.failing_since or to_rfc3339(now),
        }
    )


def settled(group: GroupStatus, now: float, policy: RestartPolicySpec) -> GroupStatus:
    """A group Ready for `resetAfterSeconds` has left its crash loop behind: its restart count
    and backoff start over now (status says so), not only at its next failure, which a drain or
    a rollout in between would otherwise keep from ever seeing the long Ready run."""
    ready_since = from_rfc3339(group.ready_since)
    if group.restarts == 0 or ready_since is None or now - ready_since < policy.reset_after_seconds:
        return group
    return group.model_copy(update={"restarts": 0, "backoff_seconds": None})


def seconds_until_restart(group: GroupStatus, now: float) -> float:
    deadline = from_rfc3339(group.next_restart_time)
    return 0.0 if deadline is None else max(deadline - now, 0.0)


def record_disruption(group: GroupStatus, reason: str, now: float) -> GroupStatus:
    """A rank deleted from outside (a drain's eviction, preemption, `kubectl delete pod`) is no
    crash: the group restarts at once and its backoff neither grows nor resets. It still counts
    towards the progress deadline: a group evicted on every start (its own ephemeral-storage
    limit, say) never reaches Ready, and must read Stalled rather than restart unseen forever."""
    return group.model_copy(
        update={
            "phase": "BackingOff",
            "ready": False,
            "last_failure": reason,
            "last_failure_time": to_rfc3339(now),
            "backoff_seconds": 0.0,
            "next_restart_time": to_rfc3339(now),
            "ready_since": None,
            "failing_since": group.failing_since or to_rfc3339(now),
        }
    )
