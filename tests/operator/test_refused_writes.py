"""Writes the API server refuses for good (403: an RBAC Role or a quota) are reported, not raised.

A refused scale write becomes a FailedScale Warning Event; a refused pod DELETE becomes a
Degraded condition (reason FailedDelete) and a Warning Event. Either way the rest of the pass
still runs, and a transient error (5xx) still raises to the work queue's backoff.
"""

from __future__ import annotations

from typing import Any

import pytest

import tessera_operator.reconcile.reconciler as reconcile_module
from tessera_operator.kube import ApiError
from tessera_operator.reconcile.reconciler import Reconciler
from tests.operator.test_reconcile_unit import (
    IC_PATH,
    PODS,
    FakeClient,
    degraded,
    fake_with_cluster,
    group_phase,
    pod_names,
    run_all,
)

FORBIDDEN = ApiError(403, {"message": 'inferenceclusters.tessera.dev "demo" is forbidden: cannot patch'})
SERVICE = "/api/v1/namespaces/ns/services/demo"


class RefusingClient(FakeClient):
    """The fake API server, answering `scale_error` to a /scale write and `delete_errors[path]` to
    a DELETE of that path."""

    def __init__(self) -> None:
        super().__init__()
        self.scale_error: ApiError | None = None
        self.delete_errors: dict[str, ApiError] = {}

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path.endswith("/scale") and self.scale_error is not None:
            self.calls.append(("PATCH", path))
            raise self.scale_error
        return await super().merge_patch(path, body)

    async def delete(self, path: str, *, uid: str | None = None) -> None:
        if path in self.delete_errors:
            self.calls.append(("DELETE", path))
            raise self.delete_errors[path]
        await super().delete(path, uid=uid)


def refusing_cluster(**spec: Any) -> RefusingClient:
    client = RefusingClient()
    client.objects.update(fake_with_cluster(**spec).objects)
    return client


def warnings(client: FakeClient, reason: str) -> list[dict[str, Any]]:
    return [e for e in client.events if e["reason"] == reason]


async def loaded_autoscaled_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[RefusingClient, Reconciler, list[float]]:
    """One Ready group whose leader reports 7 requests waiting (target 2): a pass wants 3 groups."""

    async def depths(leaders: Any, metric: str) -> list[float | None]:
        return [7.0 for _ in leaders]

    monkeypatch.setattr(reconcile_module, "queue_depths", depths)
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 2}
    client = refusing_cluster(replicas=1, autoscaling=autoscaling)
    now = [1000.0]
    reconciler = Reconciler(
        client, resync_seconds=30, clock=lambda: now[0], monotonic=lambda: now[0], autoscale_interval=15
    )  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")  # creates the pods; no leader Ready, no sample
    run_all(client)
    assert client.objects[IC_PATH]["spec"]["replicas"] == 1 and len(pod_names(client)) == 4
    return client, reconciler, now


async def test_a_refused_scale_write_is_a_failed_scale_warning_and_the_pass_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, reconciler, now = await loaded_autoscaled_cluster(monkeypatch)
    client.scale_error = FORBIDDEN
    # Work for the same pass besides the scale: a failed rank (restart the group) and a Service
    # someone deleted (recreate it).
    client.objects[PODS + "demo-g0-s1-t1"]["status"] = {"phase": "Failed", "reason": "Error"}
    del client.objects[SERVICE]
    now[0] += 20

    requeue = await reconciler.reconcile("ns", "demo")  # must not raise

    assert ("PATCH", IC_PATH + "/scale") in client.calls  # the write was tried, and refused
    assert client.objects[IC_PATH]["spec"]["replicas"] == 1
    [failed] = warnings(client, "FailedScale")
    assert failed["type"] == "Warning"
    assert failed["message"] == f"setting replicas through the scale subresource: {FORBIDDEN}"
    assert warnings(client, "ScaledUp") == []
    # The rest of the pass still happened: the restart, the Service, the sample in status.
    assert group_phase(client) == "BackingOff" and pod_names(client) == []
    assert SERVICE in client.objects
    autoscaling = client.objects[IC_PATH]["status"]["autoscaling"]
    assert (autoscaling["queueDepth"], autoscaling["desiredReplicas"]) == (7.0, 3)
    assert "lastScaleTime" not in autoscaling  # nothing was scaled
    assert requeue is not None and requeue <= 15  # the next sample retries the scale


async def test_a_transient_error_on_the_scale_write_goes_to_the_work_queue_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, reconciler, now = await loaded_autoscaled_cluster(monkeypatch)
    client.scale_error = ApiError(503, {"message": "unavailable"})
    now[0] += 20
    with pytest.raises(ApiError) as raised:
        await reconciler.reconcile("ns", "demo")
    assert raised.value.status == 503
    assert warnings(client, "FailedScale") == []


async def ready_cluster_with_a_failed_rank() -> tuple[RefusingClient, Reconciler]:
    client = refusing_cluster(replicas=1)
    reconciler = Reconciler(client, resync_seconds=9, clock=lambda: 1000.0)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")
    run_all(client)
    await reconciler.reconcile("ns", "demo")
    client.objects[PODS + "demo-g0-s1-t1"]["status"] = {"phase": "Failed", "reason": "Error"}
    return client, reconciler


async def test_a_refused_pod_delete_is_reported_as_failed_delete_and_the_other_writes_still_run() -> None:
    client, reconciler = await ready_cluster_with_a_failed_rank()
    client.delete_errors[PODS + "demo-g0-s0-t0"] = FORBIDDEN
    del client.objects[SERVICE]
    client.events.clear()

    assert await reconciler.reconcile("ns", "demo") == 9  # no raise: look again at the resync

    assert ("DELETE", PODS + "demo-g0-s0-t0") in client.calls
    assert pod_names(client) == ["demo-g0-s0-t0"]  # the other three ranks were deleted all the same
    assert SERVICE in client.objects  # and the missing Service recreated
    condition = degraded(client)
    assert condition["status"] == "True" and condition["reason"] == "FailedDelete"
    assert condition["message"] == f"deleting pod demo-g0-s0-t0: {FORBIDDEN}"
    [failed] = warnings(client, "FailedDelete")
    assert failed["type"] == "Warning" and failed["message"] == condition["message"]
    assert group_phase(client) == "BackingOff"  # the restart's intent was recorded

    del client.delete_errors[PODS + "demo-g0-s0-t0"]  # the Role is fixed
    await reconciler.reconcile("ns", "demo")
    assert pod_names(client) == [] and len(warnings(client, "FailedDelete")) == 1


@pytest.mark.parametrize("status", [404, 409])
async def test_a_pod_already_gone_or_replaced_is_not_a_failed_delete(status: int) -> None:
    client, reconciler = await ready_cluster_with_a_failed_rank()
    client.delete_errors[PODS + "demo-g0-s0-t0"] = ApiError(status, {"message": "gone"})
    client.events.clear()
    await reconciler.reconcile("ns", "demo")
    assert warnings(client, "FailedDelete") == []
    conditions = client.objects[IC_PATH]["status"]["conditions"]
    assert all(c["reason"] != "FailedDelete" for c in conditions)


async def test_a_transient_error_on_a_pod_delete_goes_to_the_work_queue_backoff() -> None:
    client, reconciler = await ready_cluster_with_a_failed_rank()
    client.delete_errors[PODS + "demo-g0-s0-t0"] = ApiError(503, {"message": "unavailable"})
    client.events.clear()
    with pytest.raises(ApiError) as raised:
        await reconciler.reconcile("ns", "demo")
    assert raised.value.status == 503
    assert warnings(client, "FailedDelete") == []
