"""spec.template.ranksPerPod = tensor: one pod per (group, stage) holding the stage's TP group."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tessera.topology import LOCAL_RANKS_ENV, Topology
from tessera_operator import builders
from tessera_operator.admission.validation import validate_object
from tessera_operator.reconcile.observe import observe
from tests.operator.sim import REF, Sim, spec_of

STAGE_PODS = {"parallelism": {"tensor": 4, "pipeline": 2}, "template": {"ranksPerPod": 4}}


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_a_group_is_one_pod_per_stage_each_running_its_stages_ranks() -> None:
    spec = spec_of(**copy.deepcopy(STAGE_PODS), placement={"mode": "required"})
    pods = builders.build_group(REF, spec, "rev1", 1)
    assert [p["metadata"]["name"] for p in pods] == ["demo-g1-s0", "demo-g1-s1"]
    leader, worker = pods
    assert leader["spec"]["hostname"] == "demo-g1-s0" and leader["spec"]["subdomain"] == "demo-ranks"
    assert leader["metadata"]["labels"]["tessera.dev/role"] == "leader"
    assert worker["metadata"]["labels"]["tessera.dev/role"] == "worker"
    assert all("tessera.dev/tp-rank" not in p["metadata"]["labels"] for p in pods)
    assert all(p["metadata"]["annotations"]["tessera.dev/group-size"] == "2" for p in pods)
    assert leader["spec"]["containers"][0]["command"] == ["tessera", "serve"]
    assert worker["spec"]["containers"][0]["command"] == ["tessera", "worker"]
    for pod, first_rank in ((leader, 0), (worker, 4)):
        env = env_of(pod)
        topology = Topology.from_env(env)  # the runtime's own reader: the pod's first rank
        assert topology.rank == first_rank and env[LOCAL_RANKS_ENV] == "4"
        assert topology.local_ranks(env) == list(range(first_rank, first_rank + 4))
        assert env["TESSERA_LEADER_ADDR"] == "demo-g1-s0.demo-ranks.ns.svc"
        # The whole stage is in the pod: no pod-affinity term to keep its ranks together.
        assert "affinity" not in pod["spec"]
    assert leader["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "readinessProbe" not in worker["spec"]["containers"][0]


def test_a_stage_pod_requests_a_gpu_for_each_of_its_ranks() -> None:
    spec = spec_of(parallelism={"tensor": 4, "pipeline": 2}, template={"ranksPerPod": 4, "gpusPerRank": 1})
    resources = builders.build_group(REF, spec, "r", 0)[1]["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"nvidia.com/gpu": 4}, "limits": {"nvidia.com/gpu": 4}}


def test_one_rank_pods_keep_their_environment_and_nccl_variables_pass_through() -> None:
    spec = spec_of(template={"env": [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}]})
    for pod in builders.build_group(REF, spec, "r", 0):
        env = env_of(pod)
        assert LOCAL_RANKS_ENV not in env and env["LOCAL_RANK"] == "0"
        assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert validate_object("demo", spec.model_dump(by_alias=True, mode="json")) == []
    assert LOCAL_RANKS_ENV in builders.RESERVED_ENV  # the user's env cannot fake a pod's rank count


def test_the_field_rolls_no_existing_cluster_and_a_stage_pod_layout_is_a_new_revision() -> None:
    """The API server now stores `ranksPerPod: 1` in every object: it hashes as before the field
    (the same values as test_builders' expert-parallel pins)."""
    before = {"": "09cfecc233", "sp": "4507cdd59c"}
    specs: dict[str, dict[str, Any]] = {
        "": {},
        "sp": {"parallelism": {"tensor": 4, "pipeline": 2, "sequenceParallel": True}},
    }
    for key, raw in specs.items():
        stored = {**copy.deepcopy(raw), "template": {"ranksPerPod": 1}}
        assert builders.revision_of(spec_of(**stored)) == before[key], key
    stage_pods = spec_of(
        parallelism={"tensor": 4, "pipeline": 2, "sequenceParallel": True}, template={"ranksPerPod": 4}
    )
    assert builders.revision_of(stage_pods) != before["sp"]
    # Placement has nothing to keep together in a pod per stage: editing it rolls nothing.
    placed = spec_of(**copy.deepcopy(STAGE_PODS), placement={"mode": "required"})
    assert builders.revision_of(placed) == builders.revision_of(spec_of(**copy.deepcopy(STAGE_PODS)))


@pytest.mark.parametrize(
    ("tensor", "per_pod", "refused"), [(4, 1, False), (4, 4, False), (4, 2, True), (1, 2, True)]
)
def test_admission_takes_one_rank_or_the_whole_tp_group_per_pod(
    tensor: int, per_pod: int, refused: bool
) -> None:
    raw = {
        "model": {"source": "llama-3.1-8b-instruct"},
        "parallelism": {"tensor": tensor, "pipeline": 2},
        "template": {"ranksPerPod": per_pod},
    }
    errors = [e for e in validate_object("demo", raw) if e.field == "spec.template.ranksPerPod"]
    assert bool(errors) == refused
    if refused:
        assert (
            f"spec.parallelism.tensor ({tensor}" in errors[0].message
            and f"got {per_pod}" in errors[0].message
        )


def test_the_pod_cap_and_the_disruption_budget_count_stage_pods() -> None:
    layout = {"model": {"source": "llama-3.1-8b-instruct"}, "parallelism": {"tensor": 8, "pipeline": 2}}
    many = {**layout, "replicas": 65}  # 1,040 rank pods > the cap of 1,024; 130 stage pods
    assert [e.field for e in validate_object("demo", many)] == ["spec.replicas"]
    assert validate_object("demo", {**many, "template": {"ranksPerPod": 8}}) == []
    spec = spec_of(**copy.deepcopy(STAGE_PODS), replicas=3)
    budget = builders.build_disruption_budget(REF, spec, "policy/v1", surge_groups=1)
    assert budget is not None and budget["spec"]["minAvailable"] == 4 * 2 - 1


def test_stage_pods_are_observed_restarted_and_rolled_as_groups() -> None:
    sim = Sim(spec_of(**copy.deepcopy(STAGE_PODS), replicas=2))
    sim.converge()
    assert sorted(sim.pods) == ["demo-g0-s0", "demo-g0-s1", "demo-g1-s0", "demo-g1-s1"]
    obs = observe(REF.name, REF.uid, sim.pods.values())
    assert not obs.strays and all(g.complete for g in obs.groups.values())
    assert sim.status.ready_replicas == 2 and [g.pods for g in sim.status.groups] == [2, 2]
    # A stage pod that exits (one of its ranks did): its whole group restarts.
    sim.fail("demo-g1-s1")
    decision = sim.step()
    assert sorted(decision.delete_pods) == ["demo-g1-s0", "demo-g1-s1"]
    # A pod deleted from a running group: the group is incomplete, and restarts.
    sim.converge()
    del sim.pods["demo-g0-s1"]
    assert "demo-g0-s0" in sim.step().delete_pods
    # Back to one rank per pod: a rollout to the rank pods' names.
    sim.converge()
    sim.spec = spec_of(parallelism={"tensor": 4, "pipeline": 2}, replicas=2)
    sim.converge()
    assert len(sim.pods) == 16 and "demo-g0-s1-t3" in sim.pods
