"""The reconciler's I/O glue against an in-memory fake client (the genuine API server is in tests/integration)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from tessera_operator.kube import ApiError
from tessera_operator.reconcile import Reconciler

_uids = itertools.count()


class FakeClient:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []

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

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("POST", path))
        if path.endswith("/events"):
            return body
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise ApiError(409, {"message": "exists"})
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = f"u{next(_uids)}"
        self.objects[full] = obj
        return obj

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", path))
        target = self.objects[path.removesuffix("/status")]
        for key, value in body["status"].items():
            if value is None:
                target.setdefault("status", {}).pop(key, None)
            else:
                target.setdefault("status", {})[key] = value
        return target

    async def delete(self, path: str, *, uid: str | None = None) -> None:
        self.calls.append(("DELETE", path))
        self.objects.pop(path, None)

    async def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> dict[str, Any]:
        self.calls.append((method, path))
        self.objects[path] = body
        return dict(body)


IC_PATH = "/apis/tessera.dev/v1alpha1/namespaces/ns/inferenceclusters/demo"


def fake_with_cluster(**spec: Any) -> FakeClient:
    client = FakeClient()
    client.objects[IC_PATH] = {
        "metadata": {"name": "demo", "namespace": "ns", "uid": "ic-uid", "generation": 3},
        "spec": {
            "model": {"source": "smollm2-135m-instruct"},
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
        == "leader"
    )

    bad = fake_with_cluster(parallelism={"tensor": 1, "pipeline": 2, "sequenceParallel": True})
    reconciler = Reconciler(bad, clock=lambda: 1000.0)  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "demo") is None
    [degraded] = bad.objects[IC_PATH]["status"]["conditions"]
    assert degraded["reason"] == "InvalidSpec" and "spec.parallelism.sequenceParallel" in degraded["message"]
    assert not [p for p in bad.objects if "/pods/" in p]


async def test_a_deleted_cluster_stops_the_loop() -> None:
    reconciler = Reconciler(FakeClient())  # type: ignore[arg-type]
    assert await reconciler.reconcile("ns", "gone") is None
