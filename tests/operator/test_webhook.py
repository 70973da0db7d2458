import asyncio
import copy
from typing import Any

import aiohttp
import kopf
import pytest

from tessera_operator import api
from tessera_operator.admission import webhook
from tessera_operator.admission.podpolicy import PodPolicy

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

    from tessera_operator.admission.certs import self_signed

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
    from tessera_operator.admission.certs import self_signed

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
    server = webhook.GuardedWebhookServer(
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
    from tessera_operator.admission.certs import SELF_SIGNED_DAYS

    assert webhook.SELF_SIGNED_RENEWAL_SECONDS < SELF_SIGNED_DAYS * 86400
    stopped = asyncio.Event()
    await asyncio.wait_for(webhook.restart_to_renew(0.01, stopped.set), timeout=5)
    assert stopped.is_set()


# --- who may call the webhook, and within which bounds ---------------------------------------

API_SERVER_NAME = "kube-apiserver-webhook-client"


class Tls:
    """A CA (as a cluster's), the webhook's serving pair, and client pairs it signed."""

    def __init__(self, directory: Any) -> None:
        from e2e.pki import Pki

        self.pki = Pki.create(directory)
        self.serving = self.pki.issue(
            "webhook", "/CN=webhook", usage="serverAuth", sans=("DNS:localhost", "IP:127.0.0.1")
        )
        self.api_server = self.pki.issue("apiserver-webhook", f"/CN={API_SERVER_NAME}", usage="clientAuth")
        self.user = self.pki.issue("user-alice", "/CN=alice/O=system:masters", usage="clientAuth")

    def client(self, pair: tuple[Any, Any] | None) -> Any:
        import ssl

        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        if pair is not None:
            context.load_cert_chain(str(pair[0]), str(pair[1]))
        return context


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return Tls(tmp_path_factory.mktemp("pki"))


def review_of(obj: dict[str, Any], uid: str = "r1", **request: Any) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "operation": "CREATE",
            "userInfo": {"username": "u"},
            "resource": {"group": api.GROUP, "version": api.VERSION, "resource": api.PLURAL},
            "object": obj,
            **request,
        },
    }


def allowing(judged: list[Any], gate: asyncio.Event | None = None) -> Any:
    async def fn(review: Any, **_: Any) -> Any:
        judged.append(review)
        if gate is not None:
            await gate.wait()
        uid = review["request"]["uid"]
        return {
            "apiVersion": review["apiVersion"],
            "kind": "AdmissionReview",
            "response": {"uid": uid, "allowed": True},
        }

    return fn


class Serving:
    """A GuardedWebhookServer on a free port, serving `fn`."""

    def __init__(self, tls: Tls, fn: Any, verify: bool = True, **options: Any) -> None:
        import ssl

        from tessera.ports import free_port

        self.port = free_port()
        extra: dict[str, Any] = {}
        if verify:
            extra = {
                "verify_cafile": str(tls.pki.ca_cert),
                "verify_mode": ssl.CERT_REQUIRED,
                "client_names": frozenset({API_SERVER_NAME}),
            }
        cert, key = tls.serving
        self.server = webhook.GuardedWebhookServer(
            addr="127.0.0.1", port=self.port, host="127.0.0.1", certfile=cert, pkeyfile=key, cafile=cert,
            **extra, **options,
        )  # fmt: skip
        self.fn = fn
        self.url = f"https://127.0.0.1:{self.port}/{webhook.HANDLER_ID}"

    async def __aenter__(self) -> "Serving":
        self.running = self.server(self.fn)
        await self.running.__anext__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.running.aclose()


async def post(url: str, context: Any, body: Any) -> tuple[int, Any]:
    import json

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, ssl=context, headers={"Content-Type": "application/json"}) as r,
    ):
        text = await r.text()
        return r.status, (json.loads(text) if r.content_type == "application/json" else text)


async def test_only_the_api_servers_client_certificate_gets_a_review_judged(tls: Tls) -> None:
    """A pod that reaches port 9443 cannot make the operator dry-run pods for it (or learn the
    cluster's admission policy from the answers): no client certificate, no TLS session; a user's
    certificate of the same cluster CA, 403; the API server's, judged."""
    judged: list[Any] = []
    review = review_of(stored(VALID, namespace="ns"))
    async with Serving(tls, allowing(judged)) as serving:
        with pytest.raises(aiohttp.ClientError):
            await post(serving.url, tls.client(None), review)
        status, text = await post(serving.url, tls.client(tls.user), review)
        assert status == 403 and "may not send admission reviews" in text
        assert judged == []
        status, answer = await post(serving.url, tls.client(tls.api_server), review)
        assert status == 200 and answer["response"]["allowed"] is True
    assert [r["request"]["uid"] for r in judged] == ["r1"]


def test_the_webhook_does_not_start_without_knowing_who_may_call_it(tmp_path: Any) -> None:
    from tessera_operator.config import OperatorConfig

    config = OperatorConfig(webhook_port=9443)
    config.webhook_client_ca, config.webhook_insecure_skip_client_auth = None, False
    assert "--webhook-client-ca" in (webhook.client_auth_problem(config) or "")
    config.webhook_client_ca = str(tmp_path / "ca.crt")
    config.webhook_client_names = frozenset()
    assert "--webhook-client-names" in (webhook.client_auth_problem(config) or "")
    config.webhook_client_names = frozenset({API_SERVER_NAME})
    assert "no such file" in (webhook.client_auth_problem(config) or "")
    (tmp_path / "ca.crt").write_text("pem")
    assert webhook.client_auth_problem(config) is None
    insecure = OperatorConfig(
        webhook_port=9443, webhook_client_ca=None, webhook_insecure_skip_client_auth=True
    )
    assert webhook.client_auth_problem(insecure) is None


def test_the_client_auth_flags(tmp_path: Any) -> None:
    from tessera_operator.__main__ import parse_args

    args = parse_args(
        [
            "-n",
            "a",
            "--webhook-client-ca",
            "/ca.crt",
            "--webhook-client-names",
            "x,y",
            "--webhook-max-in-flight",
            "2",
        ]
    )
    assert (args.webhook_client_ca, args.webhook_client_names, args.webhook_max_in_flight) == (
        "/ca.crt",
        frozenset({"x", "y"}),
        2,
    )
    assert parse_args(["-n", "a", "--webhook-insecure-skip-client-auth"]).webhook_insecure_skip_client_auth
    assert parse_args(["-n", "a", "--allow-control-plane"]).allow_control_plane


async def test_reviews_past_the_concurrency_bound_are_answered_429_at_once(tls: Tls) -> None:
    gate = asyncio.Event()
    judged: list[Any] = []
    async with Serving(tls, allowing(judged, gate), max_in_flight=2) as serving:
        context = tls.client(tls.api_server)
        held = [
            asyncio.create_task(post(serving.url, context, review_of(stored(VALID), uid=f"r{i}")))
            for i in range(2)
        ]
        while len(judged) < 2:
            await asyncio.sleep(0.01)
        status, text = await asyncio.wait_for(post(serving.url, context, review_of(stored(VALID))), timeout=5)
        assert status == 429 and "too many" in text
        gate.set()
        assert [status for status, _ in await asyncio.gather(*held)] == [200, 200]
        # The slots are free again.
        assert (await post(serving.url, context, review_of(stored(VALID))))[0] == 200


async def raw_request(serving: Serving, tls: Tls, head: bytes, body_parts: list[bytes]) -> bytes:
    """Sends `head` and `body_parts` and reads the answer without sending anything more."""
    reader, writer = await asyncio.open_connection("127.0.0.1", serving.port, ssl=tls.client(tls.api_server))
    try:
        writer.write(head)
        for part in body_parts:
            writer.write(part)
            await writer.drain()
        return await asyncio.wait_for(reader.read(4096), timeout=10)
    finally:
        writer.close()


async def test_an_oversized_review_is_refused_without_reading_it_whole(tls: Tls) -> None:
    judged: list[Any] = []
    path = f"/{webhook.HANDLER_ID}".encode()
    async with Serving(tls, allowing(judged)) as serving:
        # 10 MiB announced, 1 KiB sent: the answer comes without the rest ever arriving.
        head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        announced = head + f"Content-Length: {10 * 1024**2}\r\n\r\n".encode()
        answer = await raw_request(serving, tls, announced, [b" " * 1024])
        assert answer.startswith(b"HTTP/1.1 413"), answer
        # Chunked, with no length said: refused once past the bound, the stream never ended.
        chunk = b" " * 65536
        chunked = head + b"Transfer-Encoding: chunked\r\n\r\n"
        parts = [b"%x\r\n" % len(chunk) + chunk + b"\r\n"] * (webhook.MAX_REVIEW_BYTES // len(chunk) + 2)
        answer = await raw_request(serving, tls, chunked, parts)
        assert answer.startswith(b"HTTP/1.1 413"), answer
    assert judged == []


def deep_json(levels: int) -> str:
    return '{"a":' * (levels - 1) + "{}" + "}" * (levels - 1)


def deep_review_text(levels: int, uid: str = "deep-1") -> bytes:
    import json

    head = json.dumps(review_of(stored(VALID, namespace="ns"), uid=uid))
    marker = '"spec": {"model": {"source": "smollm2-135m-instruct"}}'
    assert marker in head
    deep_spec = (
        '"spec": {"model": {"source": "smollm2-135m-instruct"}, "template": {"affinity": '
        + deep_json(levels)
        + "}}"
    )
    return head.replace(marker, deep_spec).encode()


@pytest.mark.parametrize("levels", [300, 1500, 100_000])
async def test_a_spec_nested_too_deep_is_denied_naming_the_problem(tls: Tls, levels: int) -> None:
    """Past about 1000 levels `json.loads` raises RecursionError: the review is still answered,
    with a denial the user reads, never a crash or a 500."""
    judged: list[Any] = []
    async with Serving(tls, allowing(judged)) as serving:
        status, answer = await post(serving.url, tls.client(tls.api_server), deep_review_text(levels))
    assert status == 200 and judged == []
    response = answer["response"]
    assert (response["uid"], response["allowed"], response["status"]["code"]) == ("deep-1", False, 422)
    message = response["status"]["message"]
    if levels < 900:
        assert message.startswith("spec.template.affinity.a...: "), message
        assert f"nests deeper than {webhook.MAX_REVIEW_DEPTH} levels" in message
    else:
        assert "nests too deeply to be judged" in message
    assert f"may nest at most {api.MAX_FREE_FORM_DEPTH}" in message


async def test_a_spec_nested_too_deep_is_denied_by_the_handler_naming_the_field() -> None:
    """What the server passes on (below MAX_REVIEW_DEPTH) meets the model's own bound."""
    import json

    spec = json.loads(
        '{"model": {"source": "smollm2-135m-instruct"}, "template": {"affinity": ' + deep_json(60) + "}}"
    )
    body = kopf.Body(stored(spec))
    with pytest.raises(kopf.AdmissionError, match=r"^spec\.template\.affinity: nests deeper than 32 levels$"):
        await webhook.validate_inference_cluster(body.spec, "demo", body, "CREATE")


async def test_an_object_being_deleted_passes_however_deep(tls: Tls) -> None:
    import json

    review = json.loads(deep_review_text(300))
    review["request"]["operation"] = "UPDATE"
    review["request"]["object"]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    async with Serving(tls, allowing([])) as serving:
        status, answer = await post(serving.url, tls.client(tls.api_server), review)
    assert status == 200 and answer["response"] == {"uid": "deep-1", "allowed": True}


class DryRuns:
    """A client recording the dry-run creates the handler makes."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def create(self, path: str, body: Any, dry_run: bool = False) -> Any:
        assert dry_run
        self.paths.append(path)
        return body


async def test_no_dry_run_outside_the_watched_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's `pods/create` holds where it serves only: a review naming another namespace,
    or none, never makes it create pods (not even dry runs) elsewhere."""
    monkeypatch.setattr(webhook.CONFIG, "namespaces", ["team-b"])
    client = DryRuns()
    for metadata, namespace in (({"namespace": "team-a"}, None), ({}, None), ({}, "team-a")):
        body = kopf.Body(stored(VALID, **metadata))
        await webhook.validate_inference_cluster(
            body.spec, "demo", body, "CREATE", memo={"client": client}, namespace=namespace
        )
    assert client.paths == []
    body = kopf.Body(stored(VALID))
    await webhook.validate_inference_cluster(
        body.spec, "demo", body, "CREATE", memo={"client": client}, namespace="team-b"
    )
    assert client.paths and all(p == "/api/v1/namespaces/team-b/pods" for p in client.paths)
    monkeypatch.setattr(webhook.CONFIG, "namespaces", [])  # cluster-wide: every namespace is served
    client.paths.clear()
    body = kopf.Body(stored(VALID, namespace="team-a"))
    await webhook.validate_inference_cluster(body.spec, "demo", body, "CREATE", memo={"client": client})
    assert client.paths and all("/namespaces/team-a/" in p for p in client.paths)


async def test_the_server_takes_the_namespace_from_the_request(tls: Tls) -> None:
    """An object created without metadata.namespace: the review's `request.namespace` says it."""
    judged: list[Any] = []
    review = review_of(stored(VALID), namespace="team-b")
    async with Serving(tls, allowing(judged)) as serving:
        assert (await post(serving.url, tls.client(tls.api_server), review))[0] == 200
    assert judged[0]["request"]["object"]["metadata"]["namespace"] == "team-b"
