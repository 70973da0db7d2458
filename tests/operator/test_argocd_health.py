"""The Argo CD health check shipped in examples/argocd/ (Lua 5.1, as Argo CD's gopher-lua runs it),
judged on statuses the operator's own pure functions write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from lupa import lua51

from tessera_operator.api import InferenceClusterStatus
from tessera_operator.reconcile.status import degraded_status
from tests.operator.sim import Sim, spec_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "argocd" / "health-patch.yaml"
KEY = "resource.customizations.health.tessera.dev_InferenceCluster"


def health(status: InferenceClusterStatus | None, generation: int = 1) -> tuple[str, str]:
    script = yaml.safe_load(EXAMPLE.read_text())["data"][KEY]
    lua = lua51.LuaRuntime()
    check = lua.eval(f"function(obj)\n{script}\nend")
    obj: dict[str, Any] = {"metadata": {"name": "demo", "generation": generation}}
    if status is not None:
        obj["status"] = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    result = check(lua.table_from(obj, recursive=True))
    return str(result["status"]), str(result["message"])


def test_a_new_object_progresses_until_every_group_is_ready() -> None:
    assert health(None)[0] == "Progressing"
    sim = Sim(spec_of(replicas=2))
    sim.step()  # pods created, none running
    assert health(sim.status)[0] == "Progressing"
    sim.converge()
    sim.step()
    assert health(sim.status) == ("Healthy", sim.condition("Ready").message)
    assert health(sim.status, generation=2) == (
        "Progressing",
        "Waiting for the operator to observe generation 2",
    )


def test_a_failing_group_or_a_spec_a_person_must_fix_is_degraded() -> None:
    sim = Sim(spec_of(replicas=2))
    sim.converge()
    sim.fail(next(iter(sim.pods)))
    sim.step()
    assert health(sim.status)[0] == "Degraded"
    invalid = degraded_status(sim.status, 1, "InvalidSpec", "spec.parallelism.layerPartition: ...", sim.now)
    assert health(invalid) == ("Degraded", "spec.parallelism.layerPartition: ...")


def test_scaled_to_zero_is_suspended() -> None:
    sim = Sim(spec_of(replicas=0))
    sim.converge()
    sim.step()
    assert health(sim.status)[0] == "Suspended"


def test_pods_that_cannot_start_progress_until_the_deadline_then_degrade() -> None:
    sim = Sim(spec_of(rollout={"progressDeadlineSeconds": 60}))
    sim.step()
    waiting = {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}
    for pod in sim.pods.values():
        pod["status"] = {"phase": "Pending", "containerStatuses": [{"name": "rank", "state": waiting}]}
    sim.step()
    status, message = health(sim.status)
    assert status == "Progressing" and "ImagePullBackOff" in message
    sim.now += 61
    sim.step()
    assert health(sim.status)[0] == "Degraded"
