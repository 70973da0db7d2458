"""Reconciliation decisions on a pure simulation: creation, idempotence, restart, scale, rollout."""

import copy

from tessera_operator import builders
from tessera_operator.api import RestartPolicySpec
from tessera_operator.reconcile.planner import (
    STUCK_TERMINATING_SECONDS,
    WAIT_FOR_DELETION_SECONDS,
    WAIT_FOR_STUCK_SECONDS,
)
from tessera_operator.reconcile.restart import backoff_seconds
from tessera_operator.timeutil import to_rfc3339
from tests.operator.sim import Sim, spec_of


def test_first_pass_creates_every_group_and_a_second_pass_nothing() -> None:
    sim = Sim(spec_of(replicas=2))
    first = sim.step()
    assert first.create_groups == [0, 1] and not first.delete_pods
    assert len(sim.pods) == 8
    again = sim.step()  # pods exist, nothing started: nothing to do (an operator restart is the same)
    assert again.create_groups == [] and again.delete_pods == []


def test_ready_comes_from_the_leader_probe_not_from_running_pods() -> None:
    sim = Sim(spec_of())
    sim.step()
    sim.run_all(ready=False)
    sim.step()
    assert sim.status.ready_replicas == 0
    assert sim.condition("Ready").status == "False"
    assert sim.status.groups[0].phase == "Starting"
    # kstatus (Flux's health checks): still reconciling while no group is Ready, then Current.
    assert sim.condition("Reconciling").status == "True" and sim.condition("Stalled").status == "False"
    sim.run_all(ready=True)
    sim.step()
    assert sim.status.ready_replicas == 1 and sim.condition("Ready").status == "True"
    assert sim.condition("Progressing").status == "False"
    assert sim.condition("Reconciling").status == "False" and sim.condition("Stalled").status == "False"
    assert sim.status.groups[0].phase == "Ready"


def test_a_failed_rank_restarts_the_whole_group_with_exponential_backoff() -> None:
    sim = Sim(spec_of(replicas=2, restartPolicy={"backoffBaseSeconds": 2, "backoffMaxSeconds": 5}))
    sim.converge()
    delays = []
    for _ in range(4):
        sim.fail("demo-g1-s1-t0")
        decision = sim.step()
        assert sorted(decision.delete_pods) == [
            "demo-g1-s0-t0",
            "demo-g1-s0-t1",
            "demo-g1-s1-t0",
            "demo-g1-s1-t1",
        ]
        assert [e.reason for e in decision.events] == ["GroupFailed"]
        group = sim.status.groups[1]
        assert group.phase == "BackingOff" and "exit code 1" in (group.last_failure or "")
        assert sim.condition("Degraded").status == "True"
        delays.append(group.backoff_seconds)
        # before the deadline nothing is recreated, however often we look
        assert sim.step().create_groups == [] and sim.step().create_groups == []
        assert decision.requeue_after == group.backoff_seconds
        sim.now += group.backoff_seconds or 0
        assert sim.step().create_groups == [1]
        assert [e.reason for e in sim.last.events] == ["GroupRestarted"]
        sim.converge()
        assert set(sim.groups()) == {0, 1}
    assert delays == [2, 4, 5, 5]
    assert sim.status.groups[1].restarts == 4 and sim.status.groups[0].restarts == 0
    assert sim.condition("Degraded").status == "False"


def test_backoff_resets_after_the_group_stayed_ready_long_enough() -> None:
    policy = {"backoffBaseSeconds": 1, "backoffMaxSeconds": 100, "resetAfterSeconds": 60}
    sim = Sim(spec_of(restartPolicy=policy))
    sim.converge()
    for _ in range(3):
        sim.fail("demo-g0-s0-t0")
        sim.step()
        sim.now += 100
        sim.converge()
    assert sim.status.groups[0].restarts == 3
    sim.now += 61
    sim.step()
    # Status says so at once (not only at the next failure), so a drain or a rollout before
    # that failure cannot carry the old crash loop's backoff over.
    assert sim.status.groups[0].restarts == 0 and sim.status.groups[0].backoff_seconds is None
    del sim.pods["demo-g0-s1-t1"]  # a drain: the group restarts at once, and is Ready again
    sim.step()
    sim.converge()
    sim.now += 5
    sim.fail("demo-g0-s0-t0")
    sim.step()
    assert sim.status.groups[0].restarts == 1 and sim.status.groups[0].backoff_seconds == 1


def test_a_deleted_pod_of_a_running_group_restarts_the_group_but_a_missing_one_at_creation_does_not() -> None:
    sim = Sim(spec_of())
    sim.step()
    del sim.pods["demo-g0-s1-t1"]  # never started: just create it
    assert sim.step().create_groups == [0] and "demo-g0-s1-t1" in sim.pods
    sim.converge()
    del sim.pods["demo-g0-s1-t1"]
    decision = sim.step()
    assert len(decision.delete_pods) == 3
    assert "PodDeleted" in (sim.status.groups[0].last_failure or "")


def test_ranks_refused_at_creation_are_awaited_not_a_restart_storm() -> None:
    """A quota (or a policy) lets 3 of 4 ranks in: they start, and the fourth is created again at
    each pass; the group is not torn down as if a rank had been taken away."""
    sim = Sim(spec_of())
    sim.step()
    del sim.pods["demo-g0-s1-t1"]  # the API server refused it
    for _ in range(4):
        sim.run_all(ready=False)
        decision = sim.step()
        del sim.pods["demo-g0-s1-t1"]  # refused again
        assert decision.delete_pods == [] and decision.create_groups == [0]
        assert sim.status.groups[0].restarts == 0 and "GroupDisrupted" not in [
            e.reason for e in decision.events
        ]


def test_an_eviction_is_a_disruption_even_when_the_leader_exited_first() -> None:
    """Taking a rank away makes its leader exit non-zero within seconds: that exit is the
    eviction's doing, and the group restarts at once, without a crash's backoff."""
    for taken in ("evicted", "deleted"):
        sim = Sim(spec_of(restartPolicy={"backoffBaseSeconds": 30}))
        sim.converge()
        if taken == "evicted":
            sim.pods["demo-g0-s1-t0"]["status"] = {
                "phase": "Failed",
                "reason": "Evicted",
                "message": "low memory",
            }
        else:
            del sim.pods["demo-g0-s1-t0"]
        sim.fail("demo-g0-s0-t0")  # the leader noticed first
        decision = sim.step()
        group = sim.status.groups[0]
        assert "GroupDisrupted" in [e.reason for e in decision.events], taken
        assert group.restarts == 0 and group.backoff_seconds == 0, taken


def test_an_evicted_rank_restarts_its_group_at_once_and_repeated_drains_grow_no_backoff() -> None:
    """A drain's eviction, a preemption or `kubectl delete pod` is no crash loop: each one
    recreates the group without waiting, and the restart count that drives backoff stays."""
    sim = Sim(spec_of(restartPolicy={"backoffBaseSeconds": 30, "backoffMaxSeconds": 300}))
    sim.converge()
    for round_ in range(4):
        if round_ == 3:  # the kubelet's own eviction (memory pressure): its containers were killed
            killed = {"name": "rank", "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}
            sim.pods["demo-g0-s1-t1"]["status"] = {
                "phase": "Failed",
                "reason": "Evicted",
                "message": "The node was low on resource: memory.",
                "containerStatuses": [killed],
            }
        else:
            del sim.pods["demo-g0-s1-t1"]
        decision = sim.step()
        group = sim.status.groups[0]
        assert group.phase == "BackingOff" and group.restarts == 0 and group.backoff_seconds == 0
        assert decision.requeue_after == 0.0
        assert [e.reason for e in decision.events] == ["GroupDisrupted"]
        assert sim.step().create_groups == [0]  # the rest gone: recreated in the next pass
        sim.converge()
        sim.step()
        assert sim.status.groups[0].phase == "Ready"
    sim.fail("demo-g0-s0-t0")  # a crash still backs off
    sim.step()
    assert sim.status.groups[0].restarts == 1 and sim.status.groups[0].backoff_seconds == 30


def test_scale_adds_and_removes_whole_groups_and_strays_go() -> None:
    sim = Sim(spec_of(replicas=1))
    sim.converge()
    sim.spec = spec_of(replicas=3)
    sim.converge()
    assert set(sim.groups()) == {0, 1, 2} and len(sim.pods) == 12
    sim.spec = spec_of(replicas=1)
    decision = sim.step()
    assert len(decision.delete_pods) == 8 and set(sim.groups()) == {0}
    assert [g.index for g in sim.status.groups] == [0]
    stray = dict(sim.pods["demo-g0-s0-t0"])
    stray["metadata"] = {**stray["metadata"], "name": "demo-extra"}
    sim.pods["demo-extra"] = stray
    assert sim.step().delete_pods == ["demo-extra"]


def rollout_trace(sim: Sim, new_spec: object, max_steps: int = 40) -> list[tuple[int, int]]:
    """Roll to new_spec; record (groups existing, groups ready) after every step."""
    sim.spec = new_spec  # type: ignore[assignment]
    trace = []
    for _ in range(max_steps):
        sim.step()
        sim.run_all()
        ready = sum(1 for g in sim.status.groups if g.ready)
        trace.append((len(sim.groups()), ready))
        target = sim.status.update_revision
        if (
            all(revs == {target} for revs in sim.groups().values())
            and len(sim.groups()) == sim.spec.replicas
            and sim.condition("Progressing").status == "False"
        ):
            return trace
    raise AssertionError(f"rollout did not finish: {trace}")


def test_rolling_update_with_max_unavailable_one_replaces_one_group_at_a_time() -> None:
    sim = Sim(spec_of(replicas=3))
    sim.converge()
    old = sim.status.update_revision
    trace = rollout_trace(sim, spec_of(replicas=3, template={"image": "v2"}))
    assert all(ready >= 2 for _, ready in trace[:-1] if _ == 3)  # never more than one group down
    assert sim.status.updated_replicas == 3 and sim.status.current_revision != old


def test_replicas_one_with_max_surge_one_never_drops_to_zero_and_finishes() -> None:
    rollout = {"maxUnavailable": 0, "maxSurge": 1}
    sim = Sim(spec_of(replicas=1, rollout=rollout))
    sim.converge()
    trace = rollout_trace(sim, spec_of(replicas=1, rollout=rollout, template={"image": "v2"}))
    assert all(ready >= 1 for _, ready in trace)
    assert max(groups for groups, _ in trace) == 2  # the surge group existed
    assert set(sim.groups()) == {0}


def test_rollout_waits_for_new_groups_to_become_ready() -> None:
    rollout = {"maxUnavailable": 0, "maxSurge": 1}
    sim = Sim(spec_of(replicas=2, rollout=rollout))
    sim.converge()
    sim.spec = spec_of(replicas=2, rollout=rollout, template={"image": "v2"})
    for _ in range(5):
        sim.step()
        sim.run_all()
        for pod in sim.pods.values():  # new pods run but never get Ready
            if pod["metadata"]["labels"]["tessera.dev/revision"] == sim.status.update_revision:
                pod["status"].pop("conditions", None)
    revisions = sim.groups()
    old = {g for g, revs in revisions.items() if sim.status.update_revision not in revs}
    assert old == {0, 1}  # nothing old was torn down; capacity kept
    assert sim.condition("Progressing").reason == "RollingUpdate"


def test_a_forward_fix_mid_rollout_replaces_the_surge_group_of_the_broken_revision() -> None:
    """B's surge group never gets Ready; the user applies C: the surge group moves to C (it
    served nothing), and once C is Ready the rollout finishes."""
    rollout = {"maxUnavailable": 0, "maxSurge": 1}
    sim = Sim(spec_of(replicas=1, rollout=rollout))
    sim.converge()
    sim.spec = spec_of(replicas=1, rollout=rollout, template={"image": "broken"})
    broken = builders.revision_of(sim.spec)
    for _ in range(4):
        sim.step()
        sim.run_all()
        for pod in sim.pods.values():  # B's pods run but never become Ready
            if pod["metadata"]["labels"]["tessera.dev/revision"] == broken:
                pod["status"].pop("conditions", None)
    assert sim.groups() == {0: {builders.revision_of(spec_of(replicas=1, rollout=rollout))}, 1: {broken}}
    sim.spec = spec_of(replicas=1, rollout=rollout, template={"image": "fixed"})
    fixed = builders.revision_of(sim.spec)
    for _ in range(12):
        sim.step()
        sim.run_all()
        for pod in sim.pods.values():  # B stays broken
            if pod["metadata"]["labels"]["tessera.dev/revision"] == broken:
                pod["status"].pop("conditions", None)
    sim.step()
    assert sim.groups() == {0: {fixed}} and sim.status.updated_replicas == 1


def test_backoff_formula() -> None:
    policy = RestartPolicySpec(backoff_base_seconds=10, backoff_max_seconds=300)
    assert [backoff_seconds(n, policy) for n in range(1, 7)] == [10, 20, 40, 80, 160, 300]


def test_a_long_crash_loop_does_not_overflow_the_backoff() -> None:
    policy = RestartPolicySpec(backoffBaseSeconds=10, backoffMaxSeconds=300)
    assert backoff_seconds(2000, policy) == 300  # 2.0**1999 would raise OverflowError every pass


def test_a_group_waits_for_a_pod_stuck_terminating_and_says_why() -> None:
    """A pod on a node that is gone stays Terminating: its group cannot be recreated under the same
    names, so the operator warns (and looks less often) once the grace period is long past."""
    sim = Sim(spec_of(restartPolicy={"backoffBaseSeconds": 2, "backoffMaxSeconds": 5}))
    sim.converge()
    stuck = copy.deepcopy(sim.pods["demo-g0-s1-t1"])
    sim.fail("demo-g0-s1-t0")
    sim.step()  # the group is deleted; one of its pods never goes away
    stuck["metadata"]["deletionTimestamp"] = to_rfc3339(sim.now + 30)  # its 30 s grace period
    sim.pods[stuck["metadata"]["name"]] = stuck
    sim.now += 10
    decision = sim.step()
    assert decision.create_groups == [] and decision.requeue_after == WAIT_FOR_DELETION_SECONDS
    assert decision.events == []
    sim.now += 30 + STUCK_TERMINATING_SECONDS
    decision = sim.step()
    assert decision.create_groups == [] and decision.requeue_after == WAIT_FOR_STUCK_SECONDS
    [warning] = decision.events
    assert warning.reason == "PodsStuckTerminating" and "demo-g0-s1-t1" in warning.message
    del sim.pods["demo-g0-s1-t1"]  # force-deleted
    assert sim.step().create_groups == [0]


def test_pods_that_cannot_start_are_named_once_and_stall_the_cluster_past_the_deadline() -> None:
    sim = Sim(spec_of(rollout={"progressDeadlineSeconds": 60}))
    decision = sim.step()
    waiting = {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "nope"'}}
    for pod in sim.pods.values():
        pod["status"] = {"phase": "Pending", "containerStatuses": [{"name": "rank", "state": waiting}]}
    decision = sim.step()
    group = sim.status.groups[0]
    assert group.start_problem is not None and "ImagePullBackOff" in group.start_problem
    assert [e.reason for e in decision.events] == ["PodsNotStarting"]
    assert sim.condition("Degraded").reason == "PodsNotStarting"
    assert sim.condition("Stalled").status == "False"  # it may still pass (a registry hiccup)
    assert decision.requeue_after is not None and decision.requeue_after <= 60
    sim.now += 61
    decision = sim.step()
    assert not decision.events  # said once
    assert sim.condition("Degraded").reason == "ProgressDeadlineExceeded"
    assert sim.condition("Stalled").status == "True"
    sim.run_all()  # fixed (the image appeared): running and Ready
    sim.step()
    assert sim.status.groups[0].start_problem is None
    assert sim.condition("Degraded").status == "False" and sim.condition("Stalled").status == "False"


def test_a_group_that_keeps_failing_stalls_the_cluster_past_the_deadline_until_it_runs() -> None:
    """A crash loop (a mistyped model source, too little memory) waits for a person as much as an
    image that never pulls: GitOps tools must stop waiting for it."""
    sim = Sim(spec_of(rollout={"progressDeadlineSeconds": 60}, restartPolicy={"backoffBaseSeconds": 10}))

    def crash() -> None:  # the group's pods start, then a rank exits
        sim.step()
        sim.run_all(ready=False)
        sim.step()
        sim.fail("demo-g0-s0-t0")
        sim.step()
        sim.now += sim.status.groups[0].backoff_seconds or 0

    crash()
    assert sim.condition("Degraded").reason == "GroupRestarting"
    assert sim.condition("Stalled").status == "False"
    for _ in range(3):  # 10 + 20 + 40 s of backoff: past the 60 s deadline
        crash()
    assert sim.condition("Degraded").reason == "ProgressDeadlineExceeded"
    assert "failing for more than the 60 s progress deadline" in sim.condition("Degraded").message
    assert sim.condition("Stalled").status == "True"
    sim.converge()  # fixed: the group runs and is Ready
    assert sim.status.groups[0].failing_since is None
    assert sim.condition("Stalled").status == "False" and sim.condition("Degraded").status == "False"
    crash()  # a failure after a Ready run starts a new deadline
    assert sim.condition("Degraded").reason == "GroupRestarting"


def test_a_group_evicted_on_every_start_stalls_the_cluster_past_the_deadline() -> None:
    """An eviction grows no backoff, but a group the kubelet evicts before every Ready (its own
    ephemeral-storage limit, filled by the model cache) waits for a person like a crash loop."""
    sim = Sim(spec_of(rollout={"progressDeadlineSeconds": 60}))
    evicted = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "Pod ephemeral local storage usage exceeds the total limit of containers 10Gi.",
    }
    for _ in range(4):  # 25 s a start, never Ready: past the 60 s deadline
        sim.step()
        sim.run_all(ready=False)
        sim.now += 25
        sim.pods["demo-g0-s1-t0"]["status"] = dict(evicted)
        sim.step()
        assert sim.status.groups[0].backoff_seconds == 0
    assert sim.condition("Degraded").reason == "ProgressDeadlineExceeded"
    assert sim.condition("Stalled").status == "True"
    sim.converge()
    assert sim.status.groups[0].failing_since is None and sim.condition("Stalled").status == "False"


def test_a_fix_for_a_crash_looping_group_starts_at_once_without_its_failure_history() -> None:
    """A spec changed while a group waits out a crash backoff (a fixed image, a rollback) is what
    the person was asked for: the new revision must not wait out the old one's backoff."""
    sim = Sim(spec_of(restartPolicy={"backoffBaseSeconds": 100, "backoffMaxSeconds": 300}))
    sim.converge()
    for _ in range(3):
        sim.fail("demo-g0-s0-t0")
        sim.step()
        sim.now += sim.status.groups[0].backoff_seconds or 0
        sim.step()
        sim.run_all(ready=False)
    sim.fail("demo-g0-s0-t0")
    sim.step()  # backing off for 300 s now
    assert sim.status.groups[0].restarts == 4
    sim.spec = spec_of(
        restartPolicy={"backoffBaseSeconds": 100, "backoffMaxSeconds": 300}, template={"image": "fixed:2"}
    )
    sim.now += 1
    decision = sim.step()
    assert decision.create_groups == [0]
    group = sim.status.groups[0]
    assert (
        group.revision == builders.revision_of(sim.spec)
        and group.restarts == 0
        and group.failing_since is None
    )
    sim.run_all(ready=False)
    sim.fail("demo-g0-s0-t0")  # the new revision's own first failure: the base backoff
    sim.step()
    assert sim.status.groups[0].restarts == 1 and sim.status.groups[0].backoff_seconds == 100


def test_a_scale_down_removes_the_highest_group_even_with_surge_allowed_and_a_group_pending() -> None:
    """Scaling 3 -> 2 to free room for a group that cannot schedule: the third group is no
    rollout's surge group, and keeping it would hold the room the pending group waits for."""
    rollout = {"maxUnavailable": 1, "maxSurge": 1}
    sim = Sim(spec_of(replicas=3, rollout=rollout))
    sim.converge()
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "no room",
    }
    sim.fail("demo-g0-s0-t0")
    sim.step()
    sim.now += sim.status.groups[0].backoff_seconds or 0
    sim.step()  # group 0 recreated; its pods now wait for room
    for name in [n for n in sim.pods if n.startswith("demo-g0-")]:
        sim.pods[name]["status"] = {"phase": "Pending", "conditions": [unschedulable]}
    sim.step()
    sim.spec = spec_of(replicas=2, rollout=rollout)
    decision = sim.step()
    assert sorted(n for n in decision.delete_pods if n.startswith("demo-g2-")) == [
        f"demo-g2-s{s}-t{t}" for s in range(2) for t in range(2)
    ]
    assert set(sim.groups()) == {0, 1} and sim.last.surge == 0


def test_a_group_whose_pods_are_stuck_terminating_on_a_dead_node_becomes_stalled() -> None:
    """The taint manager deletes a dead node's pods, which stay Terminating (no kubelet confirms):
    the group waits for a person, and status says so (Degraded, then Stalled past the deadline)."""
    sim = Sim(spec_of(replicas=2, parallelism={"tensor": 4, "pipeline": 1}))
    sim.converge()
    start = sim.now
    for name, pod in sim.pods.items():
        if "-g1-" in name:
            pod["metadata"]["deletionTimestamp"] = to_rfc3339(start + 30)
    for minutes, reason in ((1, "AsExpected"), (5, "PodsNotStarting"), (15, "ProgressDeadlineExceeded")):
        sim.now = start + minutes * 60
        sim.step()
        # The API server refuses pods under the stuck names (409): only the stuck ones remain.
        sim.pods = {
            n: p for n, p in sim.pods.items() if "-g1-" not in n or "deletionTimestamp" in p["metadata"]
        }
        assert sim.condition("Degraded").reason == reason, minutes
    assert "to terminate" in (sim.status.groups[1].start_problem or "")
    assert sim.condition("Stalled").status == "True"


def test_a_condition_the_crd_defaulted_without_a_time_gets_one_and_then_keeps_it() -> None:
    from tessera_operator.api import Condition
    from tessera_operator.reconcile.status import set_condition

    defaulted = [Condition(type="Reconciling", status="True", reason="AwaitingOperator")]
    first = set_condition(
        defaulted, Condition(type="Reconciling", status="True", reason="GroupsStarting"), 1000.0
    )
    assert first[0].last_transition_time == to_rfc3339(1000.0)
    again = set_condition(
        first, Condition(type="Reconciling", status="True", reason="GroupsStarting"), 2000.0
    )
    assert again[0].last_transition_time == to_rfc3339(1000.0)  # unchanged status: the same time
