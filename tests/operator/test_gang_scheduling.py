"""spec.scheduling, pure: the rank pods' scheduler fields, the Volcano PodGroup builder and its
plan, the rules (the genuine API server: tests/integration/test_operator_gang.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tessera_operator import builders, naming
from tessera_operator.admission.podpolicy import PodPolicy
from tessera_operator.admission.validation import validate_object
from tessera_operator.kube import ApiError
from tessera_operator.pod_group_builders import (
    build_pod_group,
    desired_pod_groups,
    scaled_quantity,
    stale_pod_groups,
)
from tessera_operator.reconcile.pod_group_writes import SchedulerUnavailable, write_pod_groups
from tests.operator.sim import REF, spec_of

VOLCANO = {"scheduler": "volcano"}
KUEUE = {"scheduler": "kueue", "kueue": {"queueName": "lq", "priorityClass": "high"}}


def test_default_scheduling_changes_no_pod_and_no_revision() -> None:
    spec = spec_of()
    spelled_out = spec_of(scheduling={"scheduler": "default"})
    assert builders.revision_of(spec) == builders.revision_of(spelled_out)
    pod = builders.build_group(REF, spec, "r1", 0)[0]
    assert "schedulerName" not in pod["spec"]
    assert not any(k.startswith(("kueue.", "scheduling.")) for k in pod["metadata"]["labels"])
    assert set(pod["metadata"]["annotations"]) == {naming.GROUP_SIZE_ANNOTATION}
    assert build_pod_group(REF, spec, "r1", 0) is None


def test_the_revision_of_an_existing_default_spec_is_unchanged() -> None:
    # Pinned: the revision a default spec had before spec.scheduling existed.
    assert builders.revision_of(spec_of()) == "09cfecc233"


def test_a_scheduler_change_rolls_and_equal_spellings_do_not() -> None:
    default = builders.revision_of(spec_of())
    volcano = builders.revision_of(spec_of(scheduling=VOLCANO))
    assert volcano != default != builders.revision_of(spec_of(scheduling=KUEUE))
    assert builders.revision_of(spec_of(scheduling={**VOLCANO, "volcano": {}})) == volcano
    assert builders.revision_of(spec_of(scheduling={**VOLCANO, "volcano": {"queue": "q"}})) != volcano


def test_volcano_pods_name_their_group_and_scheduler() -> None:
    spec = spec_of(scheduling={**VOLCANO, "volcano": {"schedulerName": "vc"}})
    group = builders.build_group(REF, spec, "r1", 2)
    assert len(group) == spec.pods_per_group == 4
    for pod in group:
        assert pod["spec"]["schedulerName"] == "vc"
        assert pod["metadata"]["annotations"][builders.VOLCANO_GROUP_ANNOTATION] == "demo-g2-r1"


def test_kueue_pods_carry_the_pod_group_labels_with_the_group_size() -> None:
    spec = spec_of(scheduling=KUEUE, template={"ranksPerPod": 2})  # a pod per stage: 2 pods
    for pod in builders.build_group(REF, spec, "r1", 0):
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels[builders.KUEUE_QUEUE_LABEL] == "lq"
        assert labels[builders.KUEUE_GROUP_LABEL] == "demo-g0-r1"
        assert labels[builders.KUEUE_PRIORITY_LABEL] == "high"
        assert annotations[builders.KUEUE_TOTAL_ANNOTATION] == "2"
        assert annotations[builders.KUEUE_SERVING_ANNOTATION] == "true"
        assert "schedulerName" not in pod["spec"]


def test_the_pod_group_has_the_group_size_and_what_it_requests_together() -> None:
    spec = spec_of(
        scheduling={**VOLCANO, "volcano": {"queue": "inference"}},
        template={
            "resources": {
                "requests": {"cpu": "250m", "memory": "1Gi"},
                "limits": {"cpu": "1", "ephemeral-storage": "1G"},
            },
            "gpusPerRank": 1,
            "priorityClassName": "serving",
        },
    )
    pg = build_pod_group(REF, spec, "r1", 1)
    assert pg is not None
    assert pg["metadata"]["name"] == "demo-g1-r1"
    assert pg["metadata"]["labels"][naming.REVISION_LABEL] == "r1"
    assert pg["metadata"]["ownerReferences"][0]["uid"] == REF.uid
    assert pg["spec"] == {
        "minMember": 4,
        "minResources": {
            "cpu": "1",  # requests win over limits
            "ephemeral-storage": "4000000000",  # a limit alone requests it
            "memory": str(4 * 2**30),
            "nvidia.com/gpu": "4",
        },
        "queue": "inference",
        "priorityClassName": "serving",  # the template's, unless Volcano's own is set
    }


@pytest.mark.parametrize(
    ("value", "times", "want"),
    [("100m", 3, "300m"), ("333m", 3, "999m"), ("0.5", 3, "1500m"), (2, 4, "8"), ("1e-4", 3, "1m")],
)
def test_quantities_scale_exactly_or_round_up_to_millis(value: Any, times: int, want: str) -> None:
    assert scaled_quantity(value, times) == want


def test_pod_groups_follow_made_and_current_groups_and_go_with_their_last_pod() -> None:
    spec = spec_of(scheduling=VOLCANO)
    # group 0 runs at r2; group 1 still at r1 (keeps its own); group 2 is made now
    desired = desired_pod_groups(REF, spec, "r2", [(0, "r2"), (1, "r1")], [2])
    assert set(desired) == {"demo-g0-r2", "demo-g2-r2"}
    existing = [{"metadata": {"name": n}} for n in ("demo-g0-r2", "demo-g1-r1", "demo-g0-r1", "demo-g3-r2")]
    assert stale_pod_groups(existing, desired, ["demo-g1-r1"]) == ["demo-g0-r1", "demo-g3-r2"]


class Client:
    """The calls write_pod_groups makes, answered from `objects` (404: `served` False)."""

    def __init__(self, served: bool = True) -> None:
        self.served, self.calls, self.objects = served, [], {}  # type: ignore[var-annotated]

    async def list(self, path: str, selector: str | None = None) -> list[dict[str, Any]]:
        self.calls.append(("LIST", path))
        if not self.served:
            raise ApiError(404, {"message": "the server could not find the requested resource"})
        return [o for p, o in self.objects.items() if p.startswith(path)]

    async def get(self, path: str) -> dict[str, Any]:
        self.calls.append(("GET", path))
        if path not in self.objects:
            raise ApiError(404, {"message": "not found"})
        return dict(self.objects[path])

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("POST", path))
        self.objects[f"{path}/{body['metadata']['name']}"] = {
            **body,
            "metadata": {**body["metadata"], "uid": "pg"},
        }
        return body


def test_the_default_scheduler_asks_the_api_server_nothing() -> None:
    client = Client(served=False)
    pods = builders.build_group(REF, spec_of(), "r1", 0)
    asyncio.run(write_pod_groups(client, REF, spec_of(), "r1", pods, [], [0]))  # type: ignore[arg-type]
    assert client.calls == []


def test_volcano_without_its_api_is_refused_naming_spec_scheduling() -> None:
    with pytest.raises(SchedulerUnavailable, match=r"^spec\.scheduling\.scheduler: volcano"):
        asyncio.run(
            write_pod_groups(Client(served=False), REF, spec_of(scheduling=VOLCANO), "r1", [], [], [0])
        )  # type: ignore[arg-type]


def test_a_group_made_now_gets_its_pod_group_first() -> None:
    client = Client()
    asyncio.run(write_pod_groups(client, REF, spec_of(scheduling=VOLCANO), "r1", [], [], [0]))  # type: ignore[arg-type]
    assert client.calls[-1] == ("POST", "/apis/scheduling.volcano.sh/v1beta1/namespaces/ns/podgroups")


@pytest.mark.parametrize(
    ("scheduling", "template", "field"),
    [
        ({"scheduler": "default", "volcano": {}}, {}, "spec.scheduling.volcano"),
        ({"scheduler": "volcano", "kueue": {"queueName": "q"}}, {}, "spec.scheduling.kueue"),
        ({"scheduler": "kueue"}, {}, "spec.scheduling.kueue.queueName"),
        (
            {"scheduler": "volcano", "volcano": {"schedulerName": "default-scheduler"}},
            {},
            "spec.scheduling.volcano.schedulerName",
        ),
        (
            {"scheduler": "volcano", "volcano": {"priorityClassName": "top"}},
            {},
            "spec.scheduling.volcano.priorityClassName",
        ),
        (
            KUEUE,
            {"labels": {"kueue.x-k8s.io/queue-name": "other"}},
            "spec.template.labels[kueue.x-k8s.io/queue-name]",
        ),
        (
            VOLCANO,
            {"annotations": {"scheduling.k8s.io/group-name": "x"}},
            "spec.template.annotations[scheduling.k8s.io/group-name]",
        ),
        (
            {"scheduler": "kueue", "kueue": {"queueName": "not a label"}},
            {},
            "spec.scheduling.kueue.queueName",
        ),
    ],
)
def test_inconsistent_scheduling_is_refused_naming_the_field(
    scheduling: dict[str, Any], template: dict[str, Any], field: str
) -> None:
    raw = {"model": {"source": "llama-3.1-8b-instruct"}, "scheduling": scheduling, "template": template}
    errors = validate_object("demo", raw, PodPolicy())
    assert [e.field for e in errors] == [field], errors


def test_consistent_scheduling_passes() -> None:
    policy = PodPolicy(allowed_priority_classes=frozenset({"top"}))
    for scheduling in (
        VOLCANO,
        KUEUE,
        {"scheduler": "volcano", "volcano": {"priorityClassName": "top", "queue": "q"}},
    ):
        raw = {"model": {"source": "llama-3.1-8b-instruct"}, "scheduling": scheduling}
        assert validate_object("demo", raw, policy) == []
