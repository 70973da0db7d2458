import asyncio
import copy
from typing import Any

import aiohttp
import kopf
import pytest

from tessera_operator import api, webhook
from tessera_operator.podpolicy import PodPolicy

INVALID = {
    "model": {"source": "smollm2-135m-instruct"},
    "parallelism": {"tensor": 1, "sequenceParallel": True},
}
VALID = {"model": {"source": "smollm2-135m-instruct"}}


async def test_create_and_update_are_judged_naming_the_field() -> None:
    for operation in webhook.OPERATIONS:
        with pytest.raises(kopf.AdmissionError, match=r"spec\.parallelism\.sequenceParallel"):
            await webhook.validate_inference_cluster(INVALID, "demo", {"metadata": {}}, operation)
    await webhook.validate_inference_cluster(VALID, "demo", {"metadata": {}}, "CREATE")


async def test_delete_always_passes() -> None:
    # Even if a hand-written configuration sends it: an object must always be deletable.
    await webhook.validate_inference_cluster(INVALID, "demo", {"metadata": {}}, "DELETE")


async def test_a_generate_name_leaves_room_for_the_random_suffix() -> None:
    body = {"metadata": {"generateName": "a" * 38}}
    with pytest.raises(kopf.AdmissionError, match=r"metadata\.name"):
        await webhook.validate_inference_cluster(VALID, None, body, "CREATE")
    await webhook.validate_inference_cluster(VALID, None, {"metadata": {"generateName": "demo-"}}, "CREATE")


# Allowed when the object was made; forbidden since the operator runs without --allow-secrets.
SECRET_ENV = {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
NOW_FORBIDDEN = {**VALID, "template": {"env": [SECRET_ENV]}}
SECRET_FIELD = r"spec\.template\.env\[0\]\.valueFrom\.secretKeyRef"


@pytest.fixture
def secrets_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhook.CONFIG, "pod_policy", PodPolicy(allow_secrets=False))


def stored(spec: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    return {"metadata": {"name": "demo", "uid": "uid-1", **metadata}, "spec": copy.deepcopy(spec)}


async def update(old: dict[str, Any], new: dict[str, Any]) -> None:
    """An UPDATE the way kopf hands it over: `body` and `spec` are the new object, `old` the stored one."""
    body = kopf.Body(new)
    await webhook.validate_inference_cluster(body.spec, "demo", body, "UPDATE", old=kopf.Body(old))


@pytest.mark.usefixtures("secrets_forbidden")
async def test_a_create_with_a_forbidden_spec_is_refused_naming_the_field() -> None:
    body = kopf.Body(stored(NOW_FORBIDDEN))
    with pytest.raises(kopf.AdmissionError, match=SECRET_FIELD):
        await webhook.validate_inference_cluster(body.spec, "demo", body, "CREATE", old=None)


@pytest.mark.usefixtures("secrets_forbidden")
async def test_finalizers_come_off_an_object_being_deleted_whatever_its_spec() -> None:
    # The garbage collector's foreground deletion removes `foregroundDeletion` with an UPDATE.
    deleting = {"deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 0}
    old = stored(NOW_FORBIDDEN, finalizers=["foregroundDeletion"], **deleting)
    await update(old, stored(NOW_FORBIDDEN, finalizers=[], **deleting))
    # Even without the old object, and even if the spec changed on the way out.
    body = kopf.Body(stored(INVALID, **deleting))
    await webhook.validate_inference_cluster(body.spec, "demo", body, "UPDATE")


@pytest.mark.usefixtures("secrets_forbidden")
async def test_a_metadata_only_update_passes_whatever_its_spec() -> None:
    # Argo CD relabelling an object that predates a tightened policy.
    old = stored(NOW_FORBIDDEN, labels={"app": "demo"})
    await update(old, stored(NOW_FORBIDDEN, labels={"app": "demo", "argocd.argoproj.io/instance": "x"}))
    await update(old, stored(NOW_FORBIDDEN, annotations={"note": "x"}, finalizers=["example.com/f"]))


@pytest.mark.usefixtures("secrets_forbidden")
async def test_an_update_that_changes_the_spec_is_judged_naming_the_field() -> None:
    with pytest.raises(kopf.AdmissionError, match=SECRET_FIELD):
        await update(stored(VALID), stored(NOW_FORBIDDEN))
    with pytest.raises(kopf.AdmissionError, match=r"spec\.parallelism\.sequenceParallel"):
        await update(stored(VALID), stored(INVALID))
    # An already forbidden object changed elsewhere in its spec is judged as a whole.
    with pytest.raises(kopf.AdmissionError, match=SECRET_FIELD):
        await update(stored(NOW_FORBIDDEN), stored({**NOW_FORBIDDEN, "replicas": 2}))
    await update(stored(NOW_FORBIDDEN), stored({**VALID, "replicas": 2}))  # the way out is open


@pytest.mark.usefixtures("secrets_forbidden")
async def test_kopfs_admission_engine_hands_the_old_object_over() -> None:
    """Through kopf's own request handling (pinned kopf): `old` is the AdmissionReview's oldObject."""
    from kopf._cogs.structs import ephemera, references
    from kopf._core.engines import admission
    from kopf._core.reactor import inventory

    registry = kopf.OperatorRegistry()
    kopf.on.validate(
        api.GROUP,
        api.VERSION,
        api.PLURAL,
        id=webhook.HANDLER_ID,
        operations=set(webhook.OPERATIONS),
        registry=registry,
    )(webhook.validate_inference_cluster)
    resource = references.Resource(api.GROUP, api.VERSION, api.PLURAL, namespaced=True)
    insights = references.Insights(webhook_resources={resource})

    async def review(operation: str, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
        request = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "r1",
                "operation": operation,
                "userInfo": {"username": "argocd"},
                "resource": {"group": api.GROUP, "version": api.VERSION, "resource": api.PLURAL},
                "object": new,
                "oldObject": old,
            },
        }
        response = await admission.serve_admission_request(
            request,
            webhook=webhook.HANDLER_ID,
            settings=kopf.OperatorSettings(),
            registry=registry,
            insights=insights,
            memories=inventory.ResourceMemories(),
            memobase=ephemera.Memo(),
            indices={},
        )
        return dict(response["response"])

    relabelled = stored(NOW_FORBIDDEN, labels={"argocd.argoproj.io/instance": "x"})
    assert (await review("UPDATE", stored(NOW_FORBIDDEN), relabelled))["allowed"] is True
    refused = await review("UPDATE", stored(VALID), relabelled)
    assert refused["allowed"] is False and "secretKeyRef" in refused["status"]["message"]
    assert (await review("CREATE", None, relabelled))["allowed"] is False


async def test_objects_outside_the_watched_namespaces_are_another_operators(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two releases, one per team: team-b's operator must not judge team-a's object by its policy."""
    monkeypatch.setattr(webhook.CONFIG, "namespaces", ["team-b"])
    theirs = kopf.Body(stored(INVALID, namespace="team-a"))
    await webhook.validate_inference_cluster(theirs.spec, "demo", theirs, "CREATE")
    for namespace in ("team-b", None):  # ours, or a review that does not say: judged
        metadata = {"namespace": namespace} if namespace else {}
        body = kopf.Body(stored(INVALID, **metadata))
        with pytest.raises(kopf.AdmissionError):
            await webhook.validate_inference_cluster(body.spec, "demo", body, "CREATE")
    monkeypatch.setattr(webhook.CONFIG, "namespaces", [])  # cluster-wide: every namespace is ours
    with pytest.raises(kopf.AdmissionError):
        await webhook.validate_inference_cluster(theirs.spec, "demo", theirs, "CREATE")


def test_the_managed_configuration_carries_the_namespace_selector() -> None:
    selector = {"matchLabels": {"team": "a"}}
    [hook] = webhook.webhooks({"url": "https://op:9443"}, namespace_selector=selector)
    assert hook["namespaceSelector"] == selector and hook["failurePolicy"] == "Ignore"
    [unscoped] = webhook.webhooks({"url": "https://op:9443"})
    assert "namespaceSelector" not in unscoped


async def test_the_managed_configuration_is_written_again_while_the_operator_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Replaced or recreated meanwhile (Argo CD's Replace=true), it would stay without webhooks."""
    monkeypatch.setattr(webhook, "REASSERT_SECONDS", 0.01)
    caplog.set_level("INFO", logger=webhook.log.name)
    answers: list[Exception | None] = [
        None,
        webhook.ApiError(403, {"message": "no"}),
        None,
        aiohttp.ClientConnectionError("Cannot connect to host"),  # a control-plane upgrade
        TimeoutError(),
        None,
        None,
    ]
    writes: list[dict[str, Any]] = []

    class Client:
        async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            writes.append(body)
            answer = answers.pop(0) if answers else None
            if answer is not None:
                raise answer
            return body

    hooks = webhook.webhooks({"url": "https://op:9443"})
    server = webhook.ManagedWebhookServer(None, "cfg", Client())  # type: ignore[arg-type]
    keeper = asyncio.create_task(server.keep_current(hooks))
    while len(writes) < 8:
        await asyncio.sleep(0.01)
    assert not keeper.done()  # no failure ends it: the next write may succeed
    keeper.cancel()
    assert all(body == {"webhooks": hooks} for body in writes)
    # A failed write is logged once, its recovery once, the unchanged writes not at all.
    messages = [r.getMessage() for r in caplog.records if "ValidatingWebhookConfiguration" in r.getMessage()]
    assert [("cannot write" in m, "1 webhook(s)" in m) for m in messages] == [
        (True, False),
        (False, True),
    ] * 2


def test_a_long_service_name_still_gets_a_certificate(tmp_path: Any) -> None:
    """A CN holds 64 characters; the webhook's Service DNS name is often longer (the SANs hold it)."""
    import subprocess

    from tessera_operator.certs import self_signed

    host = "tessera-platform-operator-webhook.ml-inference-platform-production.svc"
    cert, _ = self_signed(tmp_path, host)
    text = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-text"], check=True, capture_output=True, text=True
    ).stdout
    assert f"DNS:{host}" in text


async def test_a_renewed_serving_certificate_restarts_the_operator_to_serve_it(tmp_path: Any) -> None:
    """kopf reads its certificate once; cert-manager renews the mounted Secret: the operator
    stops (the container restarts with the new one) before the old one expires."""
    import asyncio

    certfile = tmp_path / "tls.crt"
    certfile.write_text("old")
    stopped = asyncio.Event()
    watcher = asyncio.create_task(webhook.restart_when_changed(certfile, 0.05, stopped.set))
    await asyncio.sleep(0.3)
    assert not stopped.is_set()  # unchanged: nothing happens
    certfile.unlink()  # a Secret volume swaps its files: briefly absent is no change
    await asyncio.sleep(0.15)
    assert not stopped.is_set()
    certfile.write_text("renewed")
    await asyncio.wait_for(stopped.wait(), timeout=5)
    await asyncio.wait_for(watcher, timeout=5)


async def test_a_review_of_two_large_valid_objects_is_answered(tmp_path: Any) -> None:
    """An UPDATE review carries the object and the old one, each with its spec about three times
    (spec, status.appliedSpec, kubectl's last-applied): a valid 180 KiB spec makes it over 1 MiB,
    which aiohttp refused by default with a 413 before any judgement."""
    import json
    import ssl

    from tessera.ports import free_port
    from tessera_operator.certs import self_signed

    spec = {**VALID, "template": {"env": [{"name": f"CFG_{i}", "value": "x" * 30_000} for i in range(6)]}}
    applied = json.dumps({"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "spec": spec})
    stored = {
        "metadata": {
            "name": "demo",
            "namespace": "ns",
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": applied},
        },
        "spec": spec,
        "status": {"appliedSpec": spec},
    }
    labelled = copy.deepcopy(stored)
    labelled["metadata"]["labels"] = {"team": "a"}
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r1",
            "operation": "UPDATE",
            "userInfo": {"username": "u"},
            "resource": {"group": api.GROUP, "version": api.VERSION, "resource": api.PLURAL},
            "object": labelled,
            "oldObject": stored,
        },
    }
    body = json.dumps(review).encode()
    assert len(body) > 1024**2
    cert, key = self_signed(tmp_path, "localhost")
    port = free_port()
    server = webhook.LargeReviewWebhookServer(
        addr="127.0.0.1", port=port, host="localhost", certfile=cert, pkeyfile=key, cafile=cert
    )
    judged: list[str] = []

    async def allow(request: Any, **_: Any) -> Any:
        judged.append(request["request"]["uid"])
        return {
            "apiVersion": request["apiVersion"],
            "kind": "AdmissionReview",
            "response": {"uid": "r1", "allowed": True},
        }

    serving = server(allow)
    await serving.__anext__()
    try:
        async with aiohttp.ClientSession() as session:
            context = ssl.create_default_context(cafile=str(cert))
            url = f"https://localhost:{port}/validate"
            async with session.post(
                url, data=body, ssl=context, headers={"Content-Type": "application/json"}
            ) as r:
                assert r.status == 200, await r.text()
    finally:
        await serving.aclose()
    assert judged == ["r1"]


async def test_a_self_signed_serving_certificate_is_renewed_by_a_restart_before_it_expires() -> None:
    from tessera_operator.certs import SELF_SIGNED_DAYS

    assert webhook.SELF_SIGNED_RENEWAL_SECONDS < SELF_SIGNED_DAYS * 86400
    stopped = asyncio.Event()
    await asyncio.wait_for(webhook.restart_to_renew(0.01, stopped.set), timeout=5)
    assert stopped.is_set()
