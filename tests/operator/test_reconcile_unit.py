"""The reconciler's I/O glue against an in-memory fake client (the genuine API server is in tests/integration)."""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from typing import Any

import pytest

from tessera_operator import builders, naming
from tessera_operator.admission.podpolicy import PodPolicy
from tessera_operator.kube import ApiError
from tessera_operator.reconcile.events import Event
from tessera_operator.reconcile.reconciler import Reconciler
from tests.operator.sim import spec_of

_uids = itertools.count()


class FakeClient:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.events: list[dict[str, Any]] = []
        self.refuse_pods: ApiError | None = None  # what the API server answers to a pod create
        self.refuse_dry_run: ApiError | None = None  # ... and to a dry run of one

    async def get(self, path: str) -> dict[str, Any]:
        if path not in self.objects:
            raise ApiError(404, {"message": "not found"})
        return copy.deepcopy(self.objects[path])

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        key, value = (label_selector or "=").split("=")
        return [
            copy.deepcopy(o)
            for p, o in self.objects.items()
            if p.rsplit("/", 1)[0] == path and o["metadata"].get("labels", {}).get(key) == value
        ]

    async def create(self, path: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        if dry_run:  # the API server's verdict on a pod: `refuse_dry_run` or valid
            self.calls.append(("POST?dryRun", path))
            if self.refuse_dry_run is not None:
                raise self.refuse_dry_run
            return body
        self.calls.append(("POST", path))
        if path.endswith("/events"):
            if any(e["metadata"]["name"] == body["metadata"]["name"] for e in self.events):
                raise ApiError(409, {"message": "exists"})
            self.events.append(copy.deepcopy(body))
            return body
        if self.refuse_pods is not None and path.endswith("/pods"):
            raise self.refuse_pods
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise ApiError(409, {"message": "exists"})
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = f"u{next(_uids)}"
        self.objects[full] = obj
        return obj

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", path))
        if "/events/" in path:
            [event] = [e for e in self.events if e["metadata"]["name"] == path.rsplit("/", 1)[1]]
            event.update(body)
            return event
        if path.endswith("/scale"):  # the scale subresource sets spec.replicas
            target = self.objects[path.removesuffix("/scale")]
            expected = body.get("metadata", {}).get("resourceVersion")
            if expected is not None and expected != target["metadata"].get("resourceVersion"):
                raise ApiError(409, {"message": "the object has been modified"})
            target["spec"]["replicas"] = body["spec"]["replicas"]
            self.bump(target)
            return target
        target = self.objects[path.removesuffix("/status")]
        target.update(apply_merge_patch(target, body))
        self.bump(target)
        return target

    def bump(self, target: dict[str, Any]) -> None:
        """A write's new resourceVersion, as the API server gives one (the cluster object keeps one)."""
        if "resourceVersion" in target.get("metadata", {}):
            target["metadata"]["resourceVersion"] = str(int(target["metadata"]["resourceVersion"]) + 1)

    async def delete(self, path: str, *, uid: str | None = None) -> None:
        self.calls.append(("DELETE", path))
        self.objects.pop(path, None)

    async def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> dict[str, Any]:
        self.calls.append((method, path))
        self.objects[path] = body
        return dict(body)


def apply_merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386, as the API server applies a merge patch."""
    result = dict(target)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = apply_merge_patch(result[key], value)
        else:
            result[key] = value
    return result


IC_PATH = "/apis/tessera.dev/v1alpha1/namespaces/ns/inferenceclusters/demo"


def fake_with_cluster(**spec: Any) -> FakeClient:
    client = FakeClient()
    client.objects[IC_PATH] = {
        "metadata": {
            "name": "demo",
            "namespace": "ns",
            "uid": "ic-uid",
            "generation": 3,
            "resourceVersion": "1",
        },
        "spec": {
            "model": {"source": "llama-3.1-8b-instruct"},
            "parallelism": {"tensor": 2, "pipeline": 2},
            **spec,
        },
    }
    return client


async def test_a_pass_creates_pods_services_and_status_and_a_second_pass_writes_nothing() -> None:
    client = fake_with_cluster(replicas=2)
    reconciler = Reconciler(client, resync_seconds=7, clock=lambda: 1000.0)  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "demo") == 7
    pods = [p for p in client.objects if "/pods/" in p]
    services = sorted(p.rsplit("/", 1)[1] for p in client.objects if "/services/" in p)
    assert len(pods) == 8 and services == ["demo", "demo-ranks"]
    status = client.objects[IC_PATH]["status"]
    assert (
        status["observedGeneration"] == 3
        and status["selector"] == "tessera.dev/cluster=demo,tessera.dev/role=leader"
    )
    await reconciler.reconcile("ns", "demo")  # status now counts the pods it created
    client.calls.clear()
    await reconciler.reconcile("ns", "demo")
    assert client.calls == []  # level-based and idempotent: nothing to change, nothing written


async def test_drifted_service_is_repaired_and_invalid_spec_is_reported_not_acted_on() -> None:
    client = fake_with_cluster()
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    client.objects["/api/v1/namespaces/ns/services/demo"]["spec"]["selector"] = {"x": "y"}
    await reconciler.reconcile("ns", "demo")
    assert (
        client.objects["/api/v1/namespaces/ns/services/demo"]["spec"]["selector"]["tessera.dev/role"]
        == "leader"  # the router has no Ready pod yet
    )

    bad = fake_with_cluster(parallelism={"tensor": 1, "pipeline": 2, "sequenceParallel": True})
    reconciler = Reconciler(bad, clock=lambda: 1000.0)  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "demo") is None
    conditions = {c["type"]: c for c in bad.objects[IC_PATH]["status"]["conditions"]}
    degraded = conditions["Degraded"]
    assert degraded["reason"] == "InvalidSpec" and "spec.parallelism.sequenceParallel" in degraded["message"]
    # kstatus (Flux, kpt): stalled until a person fixes the spec, not still reconciling.
    assert (conditions["Stalled"]["status"], conditions["Stalled"]["reason"]) == ("True", "InvalidSpec")
    assert conditions["Reconciling"]["status"] == "False"
    assert not [p for p in bad.objects if "/pods/" in p]


async def test_a_scale_past_the_pod_cap_holds_the_groups_it_allows_and_keeps_repairing_them() -> None:
    # `kubectl scale` and an HPA write through the scale subresource, which admission never sees.
    client = fake_with_cluster(replicas=2)
    reconciler = Reconciler(client, clock=lambda: 1000.0, policy=PodPolicy(max_pods_per_cluster=12))  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    client.objects[IC_PATH]["spec"]["replicas"] = 5  # 20 pods, over the cap of 12 (3 groups)
    del client.objects[PODS + "demo-g0-s1-t1"]  # and a rank is lost meanwhile
    await reconciler.reconcile("ns", "demo")
    assert len(pod_names(client)) == 12 and "demo-g0-s1-t1" in pod_names(client)
    assert degraded(client)["reason"] == "InvalidSpec"
    assert (
        "spec.replicas" in degraded(client)["message"] and "holding 3 groups" in degraded(client)["message"]
    )
    client.objects[IC_PATH]["spec"]["replicas"] = 3  # lowered: a valid spec again
    await reconciler.reconcile("ns", "demo")
    assert degraded(client)["status"] == "False"


async def test_a_refused_edit_keeps_the_groups_running_and_repaired_as_the_last_accepted_spec() -> None:
    """With the webhook off (or after an operator upgrade tightened a rule) an invalid spec is
    stored: the groups it would change keep running, a lost rank is still replaced, and status
    says which spec runs, not Ready on the strength of the last good pass."""
    client = fake_with_cluster(replicas=2)
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    accepted = client.objects[IC_PATH]["status"]["updateRevision"]
    assert client.objects[IC_PATH]["status"]["appliedSpec"] == client.objects[IC_PATH]["spec"]
    client.objects[IC_PATH]["spec"]["parallelism"]["layerPartition"] = [30]  # two stages need two
    client.objects[IC_PATH]["metadata"]["generation"] = 4
    del client.objects[PODS + "demo-g0-s1-t1"]  # a rank is lost meanwhile
    assert await reconciler.reconcile("ns", "demo") is not None  # still resynced, not dropped
    assert "demo-g0-s1-t1" in pod_names(client) and len(pod_names(client)) == 8
    status = client.objects[IC_PATH]["status"]
    assert (
        status["updateRevision"] == accepted
        and status["appliedSpec"]["parallelism"].get("layerPartition") is None
    )
    assert degraded(client)["reason"] == "InvalidSpec"
    assert "spec.parallelism.layerPartition" in degraded(client)["message"]
    assert f"running revision {accepted}" in degraded(client)["message"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Stalled"]["status"] == "True" and conditions["Stalled"]["observedGeneration"] == 4
    client.objects[IC_PATH]["spec"]["parallelism"]["layerPartition"] = None  # fixed
    await reconciler.reconcile("ns", "demo")
    assert degraded(client)["status"] == "False"


async def test_a_deleted_cluster_stops_the_loop() -> None:
    reconciler = Reconciler(FakeClient())  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "gone") is None


def degraded(client: FakeClient) -> dict[str, Any]:
    conditions = client.objects[IC_PATH]["status"]["conditions"]
    return next(c for c in conditions if c["type"] == "Degraded")


async def test_an_overflowing_quantity_is_an_invalid_spec_with_an_event_not_a_crash() -> None:
    client = fake_with_cluster(engine={"kvCacheMemory": "1e400"})
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "demo") is None
    assert degraded(client)["reason"] == "InvalidSpec"
    assert "spec.engine.kvCacheMemory" in degraded(client)["message"]
    [event] = client.events
    assert event["type"] == "Warning" and "spec.engine.kvCacheMemory" in event["message"]


async def test_a_refused_pod_create_is_reported_once_and_cleared_when_it_succeeds() -> None:
    client = fake_with_cluster()
    client.refuse_pods = ApiError(
        422, {"message": 'Pod "demo-g0-s0-t0" is invalid: spec.tolerations[0].operator'}
    )
    now = [1000.0]
    reconciler = Reconciler(client, resync_seconds=9, clock=lambda: now[0])  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "demo") == 9
    condition = degraded(client)
    assert condition["status"] == "True" and condition["reason"] == "FailedCreate"
    assert (
        "creating pod demo-g0-s0-t0: 422" in condition["message"] and "(and 3 more)" in condition["message"]
    )
    assert [e["reason"] for e in client.events] == ["FailedCreate"]
    status_writes: list[Any] = []
    write = client.merge_patch

    async def counting(path: str, body: Any) -> Any:
        if path.endswith("/status"):
            status_writes.append(body)
        return await write(path, body)

    client.merge_patch = counting  # type: ignore[method-assign]
    now[0] += 30
    await reconciler.reconcile("ns", "demo")
    # The same failure again: no Event, and no status write, which would come back as a watch
    # event and start the next pass at once (a hot loop while a quota stays full).
    assert len(client.events) == 1 and status_writes == []
    client.refuse_pods = None
    await reconciler.reconcile("ns", "demo")
    assert degraded(client)["status"] == "False" and len([p for p in client.objects if "/pods/" in p]) == 4


async def test_a_transient_error_goes_to_the_work_queue_backoff() -> None:
    client = fake_with_cluster()
    client.refuse_pods = ApiError(503, {"message": "unavailable"})
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    with pytest.raises(ApiError):
        await reconciler.reconcile("ns", "demo")


async def test_a_build_error_is_reported_not_retried_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> list[dict[str, Any]]:
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(builders, "build_group", broken)
    client = fake_with_cluster()
    reconciler = Reconciler(client, resync_seconds=9, clock=lambda: 1000.0)  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "demo") == 9
    assert degraded(client)["reason"] == "ReconcileError"
    assert "OverflowError: int too large" in degraded(client)["message"]
    assert [e["reason"] for e in client.events] == ["ReconcileError"]


async def test_the_reconciler_applies_the_operators_pod_policy() -> None:
    spec = {"template": {"serviceAccountName": "inference"}}
    client = fake_with_cluster(**spec)
    assert await Reconciler(client, clock=lambda: 1.0).reconcile("ns", "demo") is None  # type: ignore[arg-type]
    assert "spec.template.serviceAccountName" in degraded(client)["message"]
    allowed = PodPolicy(allowed_service_accounts=frozenset({"inference"}))
    client = fake_with_cluster(**spec)
    await Reconciler(client, clock=lambda: 1.0, policy=allowed).reconcile("ns", "demo")  # type: ignore[arg-type]
    pods = [o for p, o in client.objects.items() if "/pods/" in p]
    assert len(pods) == 4 and all(p["spec"]["serviceAccountName"] == "inference" for p in pods)


async def test_a_repeated_event_is_one_object_whose_count_grows() -> None:
    """As client-go's correlator does: a second post (a repeat, or a POST retried after its answer
    was lost) bumps the count of the first Event instead of adding another object."""
    client = fake_with_cluster()
    clock = iter([1000.0, 1060.0, 1120.0])
    reconciler = Reconciler(client, clock=lambda: next(clock))  # type: ignore[arg-type]
    ref = builders.ClusterRef("demo", "ns", "ic-uid")
    refused = Event("Warning", "FailedCreate", "creating pod demo-g0-s0-t0: 422 Unprocessable")
    await reconciler.post_events(ref, [refused])
    await reconciler.post_events(ref, [refused])
    await reconciler.post_events(ref, [Event("Warning", "FailedCreate", "creating pod demo-g0-s0-t1: 403")])
    assert [(e["message"], e["count"]) for e in client.events] == [
        (refused.message, 2),
        ("creating pod demo-g0-s0-t1: 403", 1),
    ]
    assert client.events[0]["firstTimestamp"] != client.events[0]["lastTimestamp"]


PODS = "/api/v1/namespaces/ns/pods/"


def pod_names(client: FakeClient) -> list[str]:
    return sorted(p[len(PODS) :] for p in client.objects if p.startswith(PODS))


def run_all(client: FakeClient) -> None:
    for path, obj in client.objects.items():
        if path.startswith(PODS):
            obj["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}


def group_phase(client: FakeClient) -> str:
    return str(client.objects[IC_PATH]["status"]["groups"][0]["phase"])


async def test_a_group_recreated_after_backoff_survives_a_failed_write_in_that_pass() -> None:
    """The pass that recreates a group records it first: if one of its writes then fails, the
    retry must finish the group, not take it for one still backing off and tear it down."""
    client = fake_with_cluster(replicas=1)
    now = [1000.0]
    reconciler = Reconciler(client, clock=lambda: now[0])  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    run_all(client)
    await reconciler.reconcile("ns", "demo")
    client.objects[PODS + "demo-g0-s1-t1"]["status"] = {"phase": "Failed", "reason": "Error"}
    await reconciler.reconcile("ns", "demo")  # torn down, backing off 10 s
    assert group_phase(client) == "BackingOff" and pod_names(client) == []
    now[0] += 11
    create = client.create

    async def flaky(path: str, body: dict[str, Any]) -> dict[str, Any]:
        if body["metadata"]["name"] == "demo-g0-s1-t1":
            raise ApiError(503, {"message": "etcdserver: request timed out"})
        return await create(path, body)

    client.create = flaky  # type: ignore[method-assign]
    with pytest.raises(ApiError):
        await reconciler.reconcile("ns", "demo")
    client.create = create  # type: ignore[method-assign]
    assert group_phase(client) == "Pending"  # recorded before the writes
    now[0] += 1
    await reconciler.reconcile("ns", "demo")  # the work queue's retry
    assert len(pod_names(client)) == 4 and group_phase(client) == "Pending"


async def running_autoscaled_cluster(
    monkeypatch: pytest.MonkeyPatch, answers: list[float | None]
) -> tuple[FakeClient, Reconciler, list[float]]:
    """An autoscaled cluster whose group is Ready; every leader's gauge reads `answers[0]`."""
    import tessera_operator.reconcile.reconciler as reconcile_module

    async def depths(leaders: Any, metric: str) -> list[float | None]:
        return [answers[0] for _ in leaders]

    monkeypatch.setattr(reconcile_module, "queue_depths", depths)
    client = fake_with_cluster(replicas=1, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3})
    now = [1000.0]
    reconciler = Reconciler(client, clock=lambda: now[0], monotonic=lambda: now[0])  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    run_all(client)
    return client, reconciler, now


async def test_a_queue_gauge_no_queue_can_have_never_stops_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    # A broken exporter, past parse_gauge's checks.
    client, reconciler, now = await running_autoscaled_cluster(monkeypatch, [float("nan")])
    client.objects[PODS + "demo-g0-s1-t1"]["status"] = {"phase": "Failed", "reason": "Error"}
    now[0] += 20
    await reconciler.reconcile("ns", "demo")  # samples, fails to decide, and still restarts
    assert group_phase(client) == "BackingOff" and pod_names(client) == []
    assert client.objects[IC_PATH]["spec"]["replicas"] == 1


async def test_leaders_that_never_answer_are_reported_once_not_silently_left_unscaled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers: list[float | None] = [None]  # None: blocked by a NetworkPolicy, say
    client, reconciler, now = await running_autoscaled_cluster(monkeypatch, answers)

    def warnings() -> list[dict[str, Any]]:
        return [e for e in client.events if e["reason"] == "MetricsUnavailable"]

    for _ in range(3):
        now[0] += 20
        await reconciler.reconcile("ns", "demo")
    assert len(warnings()) == 1 and warnings()[0].get("count", 1) == 1
    assert "none of 1 Ready leaders answered" in warnings()[0]["message"]
    answers[0] = 2.0  # reachable again, then lost again: said again
    now[0] += 20
    await reconciler.reconcile("ns", "demo")
    assert client.objects[IC_PATH]["status"]["autoscaling"]["queueDepth"] == 2.0
    answers[0] = None
    now[0] += 20
    await reconciler.reconcile("ns", "demo")
    assert warnings()[0]["count"] == 2
    autoscaling = client.objects[IC_PATH]["status"]["autoscaling"]
    assert "queueDepth" not in autoscaling and autoscaling["measuredReplicas"] == 0  # no stale depth
    writes = len(client.calls)
    await reconciler.reconcile("ns", "demo")  # nothing changed: nothing written
    assert [c for c in client.calls[writes:] if c[0] == "PATCH"] == []


async def test_pods_an_orphaning_delete_left_are_adopted_by_the_next_cluster_of_that_name() -> None:
    client = fake_with_cluster(replicas=2)
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    run_all(client)
    await reconciler.reconcile("ns", "demo")
    # `kubectl delete ic demo --cascade=orphan` (every dependent loses its owner), then the
    # manifest applied again; the old budget was a larger cluster's.
    dependents = {
        path: obj
        for path, obj in client.objects.items()
        if path.startswith(PODS) or "/services/" in path or "/poddisruptionbudgets/" in path
    }
    assert sum("/poddisruptionbudgets/" in path for path in dependents) == 1
    for obj in dependents.values():
        obj["metadata"]["ownerReferences"] = []
    client.objects[IC_PATH]["metadata"]["uid"] = "ic-uid-2"
    budget = next(obj for path, obj in dependents.items() if "/poddisruptionbudgets/" in path)
    budget["spec"]["minAvailable"] = 15
    pods = {path: pod for path, pod in dependents.items() if path.startswith(PODS)}
    uids = {path: pod["metadata"]["uid"] for path, pod in pods.items()}
    await reconciler.reconcile("ns", "demo")
    owners = {
        path: [o["uid"] for o in client.objects[path]["metadata"]["ownerReferences"]]
        for path in dependents
        if path in client.objects
    }
    # Pods, Services and the disruption budget are all adopted: none is left for nobody to delete.
    assert set(map(tuple, owners.values())) == {("ic-uid-2",)}
    assert {path: client.objects[path]["metadata"]["uid"] for path in pods} == uids  # kept, not recreated
    assert sum(e["reason"] == "Adopted" for e in client.events) == 8
    budget = next(obj for path, obj in client.objects.items() if "/poddisruptionbudgets/" in path)
    assert budget["spec"]["minAvailable"] == 7  # this cluster's, not the old 15 that blocked every drain
    run_all(client)
    await reconciler.reconcile("ns", "demo")
    assert group_phase(client) == "Ready"


def test_only_pods_no_controller_owns_are_orphans() -> None:
    from tessera_operator.reconcile.observe import is_orphan

    pod = builders.build_group(builders.ClusterRef("demo", "ns", "u"), spec_of(), "r", 0)[0]
    assert not is_orphan(pod, "demo")  # its cluster's
    pod["metadata"]["ownerReferences"] = [{"uid": "someone-else", "controller": False}]
    assert is_orphan(pod, "demo") and not is_orphan(pod, "other")
    copy_of_it = {**pod, "metadata": {**pod["metadata"], "name": "demo-g0-s0-t0-debug"}}
    assert not is_orphan(copy_of_it, "demo")  # a name the cluster never gives: someone else's
    pod["metadata"]["ownerReferences"][0]["controller"] = True
    assert not is_orphan(pod, "demo")


async def test_another_applications_service_under_the_clusters_name_is_reported_not_taken() -> None:
    client = fake_with_cluster()
    client.objects["/api/v1/namespaces/ns/services/demo"] = {
        "metadata": {"name": "demo", "namespace": "ns", "uid": "theirs"},
        "spec": {"selector": {"app": "web"}},
    }
    await Reconciler(client, clock=lambda: 1000.0).reconcile("ns", "demo")  # type: ignore[arg-type]
    assert degraded(client)["reason"] == "FailedCreate"
    assert "a Service of that name exists and is not this cluster's" in degraded(client)["message"]
    assert client.objects["/api/v1/namespaces/ns/services/demo"]["spec"]["selector"] == {"app": "web"}


async def test_a_service_with_the_clusters_label_but_another_owner_is_not_taken_over() -> None:
    client = fake_with_cluster()
    theirs = [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "gw", "uid": "gw", "controller": True}]
    client.objects["/api/v1/namespaces/ns/services/demo"] = {
        "metadata": {
            "name": "demo",
            "namespace": "ns",
            "uid": "theirs",
            "labels": {"tessera.dev/cluster": "demo"},
            "ownerReferences": theirs,
        },
        "spec": {"type": "LoadBalancer", "selector": {"app": "gateway"}},
    }
    await Reconciler(client, clock=lambda: 1000.0).reconcile("ns", "demo")  # type: ignore[arg-type]
    assert "a Service of that name exists and is not this cluster's" in degraded(client)["message"]
    service = client.objects["/api/v1/namespaces/ns/services/demo"]
    assert service["metadata"]["ownerReferences"] == theirs and service["spec"]["selector"] == {
        "app": "gateway"
    }


async def test_a_status_this_operator_cannot_read_is_rebuilt_not_a_failure_every_pass() -> None:
    client = fake_with_cluster()
    client.objects[IC_PATH]["status"] = {"groups": [{"index": "zero", "phase": "FromTheFuture"}]}
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    assert group_phase(client) == "Pending" and len([p for p in client.objects if p.startswith(PODS)]) == 4


async def test_degraded_never_reads_false_mid_pass_while_a_recreated_group_is_refused() -> None:
    """A group backing off (Degraded=True) is recreated and its pods refused (a quota): the write
    made before the pod writes must not clear Degraded for the end of the pass to set it again."""
    client = fake_with_cluster(replicas=1)
    now = [1000.0]
    reconciler = Reconciler(client, clock=lambda: now[0])  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    run_all(client)
    now[0] += 5
    await reconciler.reconcile("ns", "demo")
    now[0] += 5
    client.objects[PODS + "demo-g0-s1-t1"]["status"] = {"phase": "Failed", "reason": "Error"}
    await reconciler.reconcile("ns", "demo")  # the group is torn down and backs off

    def degraded() -> dict[str, Any]:
        return next(c for c in client.objects[IC_PATH]["status"]["conditions"] if c["type"] == "Degraded")

    assert degraded()["status"] == "True"
    seen: list[str] = []
    patch = client.merge_patch

    async def recording(path: str, body: Any) -> Any:
        result = await patch(path, body)
        if path.endswith("/status"):
            seen.append(degraded()["status"])
        return result

    client.merge_patch = recording  # type: ignore[method-assign]
    client.refuse_pods = ApiError(403, {"message": "exceeded quota"})
    now[0] += 11  # past the backoff: the group is recreated, and refused
    await reconciler.reconcile("ns", "demo")
    assert len(seen) >= 2 and set(seen) == {"True"}, seen
    assert degraded()["reason"] == "FailedCreate"


async def test_replicas_set_by_hand_while_a_sample_is_taken_are_not_overwritten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the HPA writes the Scale it read: `kubectl scale --replicas=0` during the scrape wins."""
    import tessera_operator.reconcile.reconciler as reconcile_module

    client, reconciler, now = await running_autoscaled_cluster(monkeypatch, [20.0])

    async def scaled_by_hand_meanwhile(leaders: Any, metric: str) -> list[float | None]:
        await client.merge_patch(IC_PATH + "/scale", {"spec": {"replicas": 0}})
        return [20.0 for _ in leaders]

    monkeypatch.setattr(reconcile_module, "queue_depths", scaled_by_hand_meanwhile)
    now[0] += 20
    assert await reconciler.reconcile("ns", "demo") == 0.0  # look again at once
    assert client.objects[IC_PATH]["spec"]["replicas"] == 0
    assert not [e for e in client.events if e["reason"] in ("ScaledUp", "FailedScale")]
    await reconciler.reconcile("ns", "demo")  # the object as it is now: parked at zero, left so
    assert client.objects[IC_PATH]["spec"]["replicas"] == 0


async def test_no_scale_is_decided_while_the_spec_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups run as the last accepted spec; its replicas are not the object's, so a decision
    from them would be written again every sample and never take effect."""
    client, reconciler, now = await running_autoscaled_cluster(monkeypatch, [20.0])
    client.objects[IC_PATH]["spec"]["parallelism"] = {"tensor": 3, "pipeline": 2}  # 32 heads / 3
    for _ in range(3):
        now[0] += 20
        await reconciler.reconcile("ns", "demo")
    assert client.objects[IC_PATH]["spec"]["replicas"] == 1
    assert not [c for c in client.calls if c[1].endswith("/scale")]
    assert degraded(client)["reason"] == "InvalidSpec"


async def test_a_wall_clock_stepped_back_does_not_stop_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    import tessera_operator.reconcile.reconciler as reconcile_module

    scrapes = []

    async def depths(leaders: Any, metric: str) -> list[float | None]:
        scrapes.append(metric)
        return [0.0 for _ in leaders]

    monkeypatch.setattr(reconcile_module, "queue_depths", depths)
    client = fake_with_cluster(replicas=1, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3})
    wall, ticks = [10_000.0], [0.0]
    reconciler = Reconciler(client, clock=lambda: wall[0], monotonic=lambda: ticks[0])  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    run_all(client)
    wall[0] -= 600  # NTP steps the clock back ten minutes
    for _ in range(4):
        wall[0] += 20
        ticks[0] += 20
        await reconciler.reconcile("ns", "demo")
    assert len(scrapes) >= 4


@pytest.mark.parametrize("spec", [{"replicas": 1}, {"replicas": 2, "disruptionBudget": {"enabled": False}}])
async def test_a_cluster_that_wants_no_budget_leaves_anothers_budget_of_its_name_alone(
    spec: dict[str, Any],
) -> None:
    """Opting out of the operator's PodDisruptionBudget to keep one's own, named after the app."""
    client = fake_with_cluster(**spec)
    client.objects["/apis/policy/v1"] = {}
    budget = "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/demo"
    client.objects[budget] = {"metadata": {"name": "demo", "namespace": "ns", "uid": "mine"}, "spec": {}}
    await Reconciler(client, clock=lambda: 1000.0).reconcile("ns", "demo")  # type: ignore[arg-type]
    assert degraded(client)["status"] == "False"
    assert client.objects[budget]["metadata"]["uid"] == "mine"


async def test_a_revision_whose_pods_the_api_server_refuses_is_held_before_any_group_goes_down() -> None:
    """Pass-through pod fields pass the operator's outline checks; a dry run asks the API server
    once per revision, and a refusal holds the running groups as an invalid spec would."""
    client = fake_with_cluster(replicas=2)
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    run_all(client)
    await reconciler.reconcile("ns", "demo")
    dry_runs = [c for c in client.calls if c[0] == "POST?dryRun"]
    assert len(dry_runs) == 2  # a leader and a worker, for the one revision, once
    running = {p: o["metadata"]["uid"] for p, o in client.objects.items() if "/pods/" in p}

    cause = {
        "field": "spec.containers[0].env[9].valueFrom.fieldRef.fieldPath",
        "message": "Unsupported value",
    }
    client.refuse_dry_run = ApiError(422, {"message": "Pod is invalid", "details": {"causes": [cause]}})
    env = [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.nope"}}}]
    client.objects[IC_PATH]["spec"]["template"] = {"env": env}
    for _ in range(2):
        await reconciler.reconcile("ns", "demo")
    assert degraded(client)["reason"] == "InvalidSpec"
    assert "spec.template: the API server refuses the rank pods" in degraded(client)["message"]
    assert "env[9].valueFrom.fieldRef.fieldPath: Unsupported value" in degraded(client)["message"]
    assert {p: o["metadata"]["uid"] for p, o in client.objects.items() if "/pods/" in p} == running
    assert len([c for c in client.calls if c[0] == "POST?dryRun"]) == 4  # asked once more, not per pass

    client.refuse_dry_run = ApiError(503, {"message": "a policy webhook is down"})  # no verdict
    client.objects[IC_PATH]["spec"]["template"] = {"env": [{"name": "A", "value": "1"}]}
    await reconciler.reconcile("ns", "demo")
    assert degraded(client)["status"] == "False"  # the rollout goes on; creates will say


async def test_a_new_cluster_whose_pods_the_api_server_refuses_creates_none_until_it_takes_them() -> None:
    """A refusal may lift by itself (a policy webhook's rule changed): asked again at the resync."""
    client = fake_with_cluster()
    client.refuse_dry_run = ApiError(400, "Pod in version v1 cannot be handled as a Pod: readObjectStart")
    ticks = [0.0]
    reconciler = Reconciler(client, resync_seconds=30, clock=lambda: 1000.0, monotonic=lambda: ticks[0])  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "demo") == 30
    assert degraded(client)["reason"] == "InvalidSpec" and "readObjectStart" in degraded(client)["message"]
    assert pod_names(client) == []
    client.refuse_dry_run = None
    await reconciler.reconcile("ns", "demo")  # within the resync: the refusal stands
    assert pod_names(client) == []
    ticks[0] += 30
    await reconciler.reconcile("ns", "demo")
    assert len(pod_names(client)) == 4 and degraded(client)["status"] == "False"


@pytest.mark.parametrize(
    "answer",
    [  # the API server's 400 for a pod webhook with sideEffects Unknown (v1beta1's default)
        ApiError(400, {"message": 'admission webhook "legacy.example.com" does not support dry run'}),
        ApiError(503, {"message": "a policy webhook is down"}),
        ApiError(403, {"message": 'pods "x" is forbidden: exceeded quota: q'}),  # may fit later
    ],
)
async def test_a_dry_run_that_cannot_judge_the_pods_is_no_refusal(answer: ApiError) -> None:
    client = fake_with_cluster()
    client.refuse_dry_run = answer
    await Reconciler(client, clock=lambda: 1000.0).reconcile("ns", "demo")  # type: ignore[arg-type]
    assert len(pod_names(client)) == 4 and degraded(client)["status"] == "False"


async def test_a_dry_run_with_no_answer_in_time_is_no_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow pod webhook must not hold a webhook of ours past the API server's 10 s, failing a
    valid object closed."""
    from tessera_operator.admission import pod_dry_run

    monkeypatch.setattr(pod_dry_run, "DRY_RUN_TIMEOUT_S", 0.05)
    client = fake_with_cluster()
    create = client.create

    async def slow(path: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        if dry_run:
            await asyncio.sleep(5)
        return await create(path, body, dry_run=dry_run)

    client.create = slow  # type: ignore[method-assign]
    started = time.monotonic()
    await Reconciler(client, clock=lambda: 1000.0).reconcile("ns", "demo")  # type: ignore[arg-type]
    assert time.monotonic() - started < 2
    assert len(pod_names(client)) == 4


# --- issue 63: the group secret and the NetworkPolicies ---

SECRET = "/api/v1/namespaces/ns/secrets/demo-group-secret"
POLICIES = "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies/"


async def test_the_group_secret_is_created_owned_before_the_pods_with_a_key_per_group() -> None:
    client = fake_with_cluster(replicas=2)
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    secret = client.objects[SECRET]
    assert secret["type"] == "Opaque" and sorted(secret["data"]) == ["group-0", "group-1"]
    [owner] = secret["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"], owner["kind"]) == ("ic-uid", True, "InferenceCluster")
    posts = [path for method, path in client.calls if method == "POST"]
    assert posts.index("/api/v1/namespaces/ns/secrets") < posts.index("/api/v1/namespaces/ns/pods")
    for name in pod_names(client):
        group = name.split("-g")[1].split("-")[0]
        [volume] = [v for v in client.objects[PODS + name]["spec"]["volumes"] if "secret" in v]
        assert volume["secret"]["items"] == [{"key": f"group-{group}", "path": "secret"}]
    # Its values appear in no Event and nowhere in status.
    values = list(secret["data"].values())
    said = repr(client.events) + repr(client.objects[IC_PATH].get("status"))
    assert not any(v in said for v in values)


async def test_a_new_group_gets_a_key_and_running_groups_keep_theirs() -> None:
    client = fake_with_cluster(replicas=2)
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    before = dict(client.objects[SECRET]["data"])
    client.objects[IC_PATH]["spec"]["replicas"] = 3
    await reconciler.reconcile("ns", "demo")
    after = client.objects[SECRET]["data"]
    assert sorted(after) == ["group-0", "group-1", "group-2"]
    assert {k: after[k] for k in before} == before  # never rotated while their pods live
    # A group restarted as a whole keeps its key too (no rotation: the choice documented).
    for name in [n for n in pod_names(client) if n.startswith("demo-g0-")]:
        del client.objects[PODS + name]
    await reconciler.reconcile("ns", "demo")
    assert client.objects[SECRET]["data"]["group-0"] == before["group-0"]


async def test_a_secret_of_that_name_the_cluster_does_not_control_is_refused_and_no_pod_made() -> None:
    client = fake_with_cluster()
    client.objects[SECRET] = {
        "metadata": {"name": "demo-group-secret", "namespace": "ns", "uid": "someone"},
        "data": {"group-0": "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE="},
    }
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    assert pod_names(client) == []
    assert degraded(client)["reason"] == "FailedCreate"
    assert "secret demo-group-secret" in degraded(client)["message"]
    assert "QUFB" not in repr(client.events)


async def test_network_policies_follow_spec_network_policy() -> None:
    client = fake_with_cluster(networkPolicy={"enabled": True, "clientPodSelector": {"app": "chat"}})
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    names = sorted(p[len(POLICIES) :] for p in client.objects if p.startswith(POLICIES))
    assert names == ["demo-clients", "demo-ranks"]
    ranks = client.objects[POLICIES + "demo-ranks"]
    assert ranks["metadata"]["ownerReferences"][0]["uid"] == "ic-uid"
    assert ranks["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/managed-by"] == "tessera-operator"
    client.objects[IC_PATH]["spec"]["networkPolicy"] = {"enabled": True, "clientPodSelector": {"app": "web"}}
    await reconciler.reconcile("ns", "demo")
    peer = client.objects[POLICIES + "demo-clients"]["spec"]["ingress"][0]["from"][0]
    assert peer == {"podSelector": {"matchLabels": {"app": "web"}}}
    client.objects[IC_PATH]["spec"]["networkPolicy"] = {"enabled": False}
    await reconciler.reconcile("ns", "demo")
    assert not [p for p in client.objects if p.startswith(POLICIES)]


# --- issue 63: the owned-object watch resumes, backs off with jitter, lists again only on 410 ---


class ScriptedWatchClient:
    """list_object and watch answer from scripts; each watch call takes the next script."""

    def __init__(self, watches: list[Any]) -> None:
        self.watches = watches
        self.lists = 0
        self.watch_versions: list[str] = []

    async def list_object(self, path: str, selector: str | None = None) -> dict[str, Any]:
        self.lists += 1
        return {"metadata": {"resourceVersion": f"L{self.lists}"}, "items": []}

    async def watch(self, path: str, params: dict[str, str]) -> Any:
        self.watch_versions.append(params["resourceVersion"])
        if not self.watches:
            raise asyncio.CancelledError
        script = self.watches.pop(0)
        if isinstance(script, BaseException):
            raise script
        for event in script:
            yield event


def pod_event(version: str) -> dict[str, Any]:
    labels = {"tessera.dev/cluster": "demo"}
    return {
        "type": "MODIFIED",
        "object": {"metadata": {"namespace": "ns", "labels": labels, "resourceVersion": version}},
    }


async def test_the_owned_watch_resumes_from_the_last_version_backs_off_and_lists_again_on_410() -> None:
    from tessera_operator.reconcile import ownedwatch

    gone = {"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}
    client = ScriptedWatchClient(
        [
            [pod_event("5"), pod_event("7")],  # the server ends the stream: resume from 7, no list
            OSError("connection reset"),
            OSError("connection reset"),
            OSError("connection reset"),
            [pod_event("9"), gone],  # expired: list again
            [],  # ends at once with nothing: counts as a failure
        ]
    )
    clock = itertools.count()
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    seen: list[tuple[str, str]] = []
    with pytest.raises(asyncio.CancelledError):
        await ownedwatch.watch_owned(
            client,  # type: ignore[arg-type]
            "pods",
            "ns",
            lambda ns, c: seen.append((ns, c)),
            sleep=sleep,
            rand=lambda: 1.0,
            monotonic=lambda: next(clock) * 0.1,
        )
    assert client.lists == 2  # the first listing, and once after the 410
    assert client.watch_versions == ["L1", "7", "7", "7", "7", "L2", "L2"]
    assert sleeps == [0.5, 1.0, 2.0, 1.0]  # exponential; the 410 lists again at once, its next failure waits
    assert seen == [("ns", "demo")] * 3
    # Jitter: half of each wait is random, and waits stop growing at the cap.
    assert ownedwatch.backoff_delay(3, lambda: 0.0) == 1.0
    assert ownedwatch.backoff_delay(50, lambda: 1.0) == ownedwatch.BACKOFF_MAX_SECONDS


# --- issue 63: a spec the model cannot read, decoded however deep it is ---


def nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


async def test_a_spec_1500_levels_deep_is_degraded_once_and_never_raises() -> None:
    client = fake_with_cluster()
    client.objects[IC_PATH]["spec"]["template"] = {"affinity": nested(1500)}
    plain_get = client.get

    async def get(path: str) -> dict[str, Any]:  # the fake's deepcopy could not copy it either
        obj = client.objects.get(path)
        return (
            {**obj, "metadata": dict(obj["metadata"])} if path == IC_PATH and obj else await plain_get(path)
        )

    client.get = get  # type: ignore[method-assign]
    reconciler = Reconciler(client, resync_seconds=5, clock=lambda: 1000.0)  # type: ignore[arg-type]
    for _ in range(3):  # every pass: the same condition, no exception, no new Event
        await reconciler.reconcile("ns", "demo")
    assert degraded(client)["reason"] == "InvalidSpec"
    assert "spec.template.affinity" in degraded(client)["message"]
    assert [e["reason"] for e in client.events] == ["InvalidSpec"]
    assert pod_names(client) == []


async def test_an_exception_while_judging_the_spec_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tessera_operator.reconcile import reconciler as reconcile

    def broken(*_: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(reconcile, "validate_object", broken)
    client = fake_with_cluster()
    reconciler = Reconciler(client, resync_seconds=5, clock=lambda: 1000.0)  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "demo") == 5
    assert await reconciler.reconcile("ns", "demo") == 5
    assert degraded(client)["reason"] == "InvalidSpec" and "RecursionError" in degraded(client)["message"]
    assert len(client.events) == 1


def test_api_answers_decode_however_deep_the_api_server_stores_them_and_kopf_too() -> None:
    import json
    import sys

    from kopf._cogs.clients import api as kopf_api

    from tessera_operator import kube
    from tessera_operator.reconcile import handlers

    text = '{"a":' * 1500 + "{}" + "}" * 1500
    with pytest.raises(RecursionError):
        json.loads(text)
    limit = sys.getrecursionlimit()
    value = kube.loads(text)
    assert sys.getrecursionlimit() == limit  # raised only while it decoded
    assert isinstance(value, dict) and "a" in value
    with pytest.raises(ValueError, match="deeper than"):
        kube.loads('{"a":' * 20000 + "{}" + "}" * 20000)
    handlers.decode_deep_json_in_kopf()
    assert kopf_api.json.loads(text.encode().decode()) is not None  # kopf's watch lines
    import aiohttp

    assert getattr(aiohttp.ClientResponse.json, "_tessera", False)  # kopf's lists


async def test_a_leader_is_marked_leaving_before_it_is_deleted() -> None:
    client = fake_with_cluster(replicas=2)
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    client.objects[IC_PATH]["spec"]["replicas"] = 1  # scale-in: group 1 goes
    client.calls.clear()
    await reconciler.reconcile("ns", "demo")
    leader, worker = "/api/v1/namespaces/ns/pods/demo-g1-s0-t0", "/api/v1/namespaces/ns/pods/demo-g1-s1-t1"
    assert [c for c in client.calls if c[1] == leader] == [("PATCH", leader), ("DELETE", leader)]
    assert [c for c in client.calls if c[1] == worker] == [("DELETE", worker)]


async def test_the_client_service_moves_to_the_router_once_it_has_a_ready_pod() -> None:
    client = fake_with_cluster()
    reconciler = Reconciler(client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    service, deployment = (
        "/api/v1/namespaces/ns/services/demo",
        "/apis/apps/v1/namespaces/ns/deployments/demo-router",
    )
    assert client.objects[service]["spec"]["selector"] == naming.rank_leader_selector("demo")
    client.objects[deployment]["status"] = {"readyReplicas": 1}
    await reconciler.reconcile("ns", "demo")
    assert client.objects[service]["spec"]["selector"] == naming.router_selector("demo")
    client.objects[IC_PATH]["spec"]["router"] = {"enabled": False}  # off: back to the leaders at once
    await reconciler.reconcile("ns", "demo")
    assert client.objects[service]["spec"]["selector"] == naming.rank_leader_selector("demo")
    assert deployment not in client.objects
