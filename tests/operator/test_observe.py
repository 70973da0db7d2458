"""Which labelled pods are the cluster's: only those it controls, whatever else carries its label."""

import copy
from typing import Any

import pytest

from tessera_operator import builders
from tessera_operator.reconcile.observe import observe
from tests.operator.sim import REF, Sim, spec_of

SPEC = spec_of()  # one group of 4 pods: demo-g0-s{0,1}-t{0,1}
OURS = builders.owner_reference(REF)


def group_pods() -> list[dict[str, Any]]:
    return builders.build_group(REF, SPEC, builders.revision_of(SPEC), 0)


def relabelled(pod: dict[str, Any], name: str, owners: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A copy of one of our pods under another name and owners (its labels, selector-matching, kept)."""
    other = copy.deepcopy(pod)
    other["metadata"]["name"] = name
    if owners is None:
        other["metadata"].pop("ownerReferences", None)
    else:
        other["metadata"]["ownerReferences"] = owners
    return other


FOREIGN_OWNERS = {
    # `kubectl debug --copy-to`, a client pod labelled to pass the NetworkPolicy: no owner at all.
    "no owner": None,
    # A Job's pod (or another controller's) that carries the label.
    "another controller": [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "load", "uid": "uid-job", "controller": True}
    ],
    # Another InferenceCluster's uid: a copy of its pod, or a recreated cluster's leftovers.
    "another cluster": [{**OURS, "uid": "uid-2"}],
    # Ours as a plain owner (garbage collection), another object as the controller or none at all.
    "ours but not controller": [{**OURS, "controller": False}],
    "ours without a controller field": [{k: v for k, v in OURS.items() if k != "controller"}],
    "ours, but another controls it": [
        {**OURS, "controller": False},
        {"apiVersion": "batch/v1", "kind": "Job", "name": "load", "uid": "uid-job", "controller": True},
    ],
}


@pytest.mark.parametrize("owners", FOREIGN_OWNERS.values(), ids=FOREIGN_OWNERS.keys())
def test_a_labelled_pod_the_cluster_does_not_control_is_neither_stray_nor_counted(
    owners: list[dict[str, Any]] | None,
) -> None:
    pods = group_pods()
    intruder = relabelled(pods[0], "demo-debug-copy", owners)
    observation = observe(REF.name, REF.uid, [*pods, intruder])
    assert observation.strays == []
    assert set(observation.groups[0].pods) == {p["metadata"]["name"] for p in pods}


@pytest.mark.parametrize("owners", FOREIGN_OWNERS.values(), ids=FOREIGN_OWNERS.keys())
def test_a_pod_the_cluster_does_not_control_never_counts_even_under_its_name(
    owners: list[dict[str, Any]] | None,
) -> None:
    # Under the exact name a rank would get: not counted towards a group, and not deleted.
    pods = [relabelled(p, p["metadata"]["name"], owners) for p in group_pods()]
    observation = observe(REF.name, REF.uid, pods)
    assert observation.strays == [] and observation.groups == {}


def test_a_pod_the_cluster_controls_outside_its_naming_scheme_is_still_a_stray() -> None:
    pods = group_pods()
    renamed = relabelled(pods[0], "demo-extra", [OURS])
    unlabelled = relabelled(pods[1], "demo-g0-s0-t9", [OURS])
    del unlabelled["metadata"]["labels"]["tessera.dev/group"]
    observation = observe(REF.name, REF.uid, [*pods, renamed, unlabelled])
    assert sorted(observation.strays) == ["demo-extra", "demo-g0-s0-t9"]
    assert len(observation.groups[0].pods) == 4


def test_the_planner_leaves_pods_it_does_not_control_alone() -> None:
    sim = Sim(spec_of(replicas=1))
    sim.converge()
    leader = sim.pods["demo-g0-s0-t0"]
    foreign = {
        f"demo-{kind.replace(' ', '-').replace(',', '')}": owners for kind, owners in FOREIGN_OWNERS.items()
    }
    for name, owners in foreign.items():
        sim.pods[name] = relabelled(leader, name, owners)
        sim.pods[name]["status"] = {"phase": "Failed"}  # not even a failed one restarts our group
    decision = sim.step()
    assert decision.delete_pods == [] and decision.create_groups == []
    assert set(foreign) <= set(sim.pods)
    assert sim.status.ready_replicas == 1 and sim.status.groups[0].pods == 4
