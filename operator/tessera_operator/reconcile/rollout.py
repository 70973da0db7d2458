"""Rolling update across replica groups, counted in whole groups.

Invariants (as Deployments keep them, but per group): at most `replicas + maxSurge` groups
exist, at least `replicas - maxUnavailable` groups stay Ready while old ones are replaced.
Surge groups (indices replicas..) stay until every ordinal group is updated and Ready, so
replicas=1 with maxSurge=1 never drops to zero and never deadlocks: the surge group carries
the load while group 0 is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupState:
    index: int
    exists: bool
    updated: bool  # all pods at the current revision (or the group is being recreated at it)
    ready: bool


def surge_count(replicas: int, max_surge: int, ordinal: list[GroupState], surge_exists: bool) -> int:
    """How many surge groups should exist now."""
    outdated = [g for g in ordinal if g.exists and not g.updated]
    pending = [g for g in ordinal if not (g.updated and g.ready)]
    if outdated or (surge_exists and pending):
        return min(max_surge, len(pending))
    return 0


def choose_replacements(
    replicas: int, max_unavailable: int, ordinal: list[GroupState], surge: list[GroupState]
) -> list[int]:
    """Outdated groups to tear down now (highest index first, like a StatefulSet). Surge groups
    count too: one made for an earlier revision (the spec changed again mid-rollout) would
    otherwise keep that revision forever, and the rollout would wait on it forever."""
    available = sum(1 for g in ordinal + surge if g.ready)
    min_available = max(replicas - max_unavailable, 0)
    chosen = []
    for group in sorted(ordinal + surge, key=lambda g: -g.index):
        if not group.exists or group.updated:
            continue
        if not group.ready:
            chosen.append(group.index)  # not serving anyway: replacing it costs no capacity
        elif available - 1 >= min_available:
            chosen.append(group.index)
            available -= 1
    return chosen
