"""Validating admission webhook: every rule of `validation.py`, each error naming its field.

The schema already rejects wrong types and ranges; this adds what structural schemas cannot
say in Kubernetes 1.20 (no CEL). It judges CREATE and UPDATE only: a DELETE must always pass.
An UPDATE is judged only when it changes the spec of an object not being deleted: after a policy
is tightened (e.g. `--allow-secrets` off), an existing object must still lose its finalizers (the
garbage collector's foreground deletion) and take label or annotation changes (Argo CD).

With `--webhook-managed NAME` the operator keeps the ValidatingWebhookConfiguration NAME
current (its URL and CA change with the serving certificate). kopf's own managed mode first
*creates* the configuration, a right RBAC cannot limit to one name (it would let the operator
register webhooks that receive any object, Secrets included); here the chart creates it and
the operator only patches that one object (`resourceNames`), again every minute (a configuration
replaced or recreated meanwhile gets its webhooks back). Without the object it tries to
create it (dev setups with broad rights) and otherwise logs why no webhook is registered.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import kopf

from tessera_operator import api
from tessera_operator.builders import ClusterRef, revision_of
from tessera_operator.certs import SELF_SIGNED_DAYS, self_signed
from tessera_operator.config import CONFIG, OperatorConfig
from tessera_operator.fielderror import FieldError
from tessera_operator.kube import ApiError, KubeClient
from tessera_operator.pod_dry_run import refused_pod_fields
from tessera_operator.validation import validate_object

log = logging.getLogger("tessera_operator.webhook")
HANDLER_ID = "tessera-validate"  # also the URL path the API server calls
WEBHOOK_NAME = "validate.inferenceclusters.tessera.dev"
# How often the managed configuration is written again (see ManagedWebhookServer.keep_current).
REASSERT_SECONDS = 60.0
OPERATIONS: tuple[Literal["CREATE"], Literal["UPDATE"]] = ("CREATE", "UPDATE")
CONFIGURATIONS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
GENERATED_SUFFIX = "x" * 5  # the API server appends 5 characters to a generateName
CERT_CHECK_SECONDS = 30.0  # a Secret volume takes about a minute to show a renewal anyway
_registered = False


async def validate_inference_cluster(
    spec: Any,
    name: str | None,
    body: Any,
    operation: str | None = None,
    old: Any = None,
    memo: Any = None,
    namespace: str | None = None,
    **_: Any,
) -> None:
    if operation not in OPERATIONS:  # a hand-written configuration may still send DELETE
        return
    if not watched(body, CONFIG.namespaces):
        return  # another operator's (another release, another pod policy): not ours to judge
    if operation == "UPDATE" and not update_needs_judging(old, body, spec):
        return
    generate_name = (body.get("metadata") or {}).get("generateName")
    name = name or (generate_name + GENERATED_SUFFIX if generate_name else "generated")
    errors = validate_object(name, dict(spec), CONFIG.pod_policy)
    client = (memo or {}).get("client")
    if not errors and client is not None:  # the API server's own verdict on the pods it would make
        errors = await pod_errors(client, name, namespace, body, spec)
    if errors:
        raise kopf.AdmissionError("; ".join(str(e) for e in errors), code=422)


async def pod_errors(
    client: KubeClient, name: str, namespace: str | None, body: Any, spec: Any
) -> list[FieldError]:
    meta = body.get("metadata") or {}
    ref = ClusterRef(name, meta.get("namespace") or namespace or "default", meta.get("uid") or "")
    parsed = api.InferenceClusterSpec.model_validate(dict(spec))
    return await refused_pod_fields(client, ref, parsed, revision_of(parsed)) or []


def watched(body: Any, namespaces: list[str]) -> bool:
    """Whether the object lies in a namespace this operator serves (all, when none are named).

    A webhook configuration cannot always be limited to those namespaces (Kubernetes 1.20 has no
    `kubernetes.io/metadata.name` label to select them by), so the handler itself lets others'
    objects pass; an object whose namespace the review does not say is judged.
    """
    namespace = (body.get("metadata") or {}).get("namespace")
    return not namespaces or not namespace or namespace in namespaces


def update_needs_judging(old: Any, body: Any, spec: Any) -> bool:
    """Whether an UPDATE is worth judging: it sets a new spec on an object that is not going away.

    `old` is the stored object (kopf passes the AdmissionReview's `oldObject`); without it the
    update is judged, as before.
    """
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return False  # finalizers must come off, whatever the policy says now
    if old is None:
        return True
    return dict(old.get("spec") or {}) != dict(spec or {})


def register() -> None:
    """Register the handler; only when a server is configured (kopf refuses handlers without one)."""
    global _registered
    if not _registered:
        kopf.on.validate(  # type: ignore[arg-type]
            api.GROUP, api.VERSION, api.PLURAL, id=HANDLER_ID, operations=set(OPERATIONS)
        )(validate_inference_cluster)
        _registered = True


def webhooks(
    client_config: dict[str, Any],
    service: str | None = None,
    failure_policy: str = "Ignore",
    namespace_selector: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The `webhooks` of the configuration (the chart's static template holds the same rules).

    kopf hands over a URL; with `service` ("NAMESPACE/NAME") the API server is pointed at that
    Service instead, at the URL's port: an API server on the host network may not resolve
    in-cluster names. `namespace_selector` limits the namespaces whose objects are sent at all."""
    config = dict(client_config)
    if "url" in config:
        config["url"] = f"{config['url'].rstrip('/')}/{HANDLER_ID}"
    if service is not None and "url" in config:
        namespace, name = service.split("/", 1)
        port = urlsplit(config.pop("url")).port or 443
        config["service"] = {"namespace": namespace, "name": name, "port": port, "path": f"/{HANDLER_ID}"}
    return [
        {
            "name": WEBHOOK_NAME,
            "rules": [
                {
                    "apiGroups": [api.GROUP],
                    "apiVersions": [api.VERSION],
                    "resources": [api.PLURAL],
                    "operations": list(OPERATIONS),
                    "scope": "Namespaced",
                }
            ],
            "clientConfig": config,
            "admissionReviewVersions": ["v1", "v1beta1"],
            "sideEffects": "None",
            "failurePolicy": failure_policy,
            "matchPolicy": "Equivalent",
            "timeoutSeconds": 10,
            **({"namespaceSelector": namespace_selector} if namespace_selector else {}),
        }
    ]


class ManagedWebhookServer:
    """kopf's HTTPS webhook server, plus one named ValidatingWebhookConfiguration kept current."""

    def __init__(
        self,
        server: kopf.WebhookServer,
        configuration: str,
        client: KubeClient,
        service: str | None = None,
        failure_policy: str = "Ignore",
        namespace_selector: dict[str, Any] | None = None,
    ) -> None:
        self.server = server
        self.configuration = configuration
        self.client = client
        self.service, self.failure_policy = service, failure_policy
        self.namespace_selector = namespace_selector
        self.failing = False  # the last write was refused

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        registered = False
        keeper: asyncio.Task[None] | None = None
        try:
            async with self.server:
                async for client_config in self.server(fn):
                    hooks = webhooks(
                        dict(client_config), self.service, self.failure_policy, self.namespace_selector
                    )
                    registered = await self.write(hooks) or registered
                    if keeper is not None:
                        keeper.cancel()
                    keeper = asyncio.create_task(self.keep_current(hooks))
                    yield client_config
        finally:
            if keeper is not None:
                keeper.cancel()
            if registered:  # like kopf: no webhook left behind without its server
                with contextlib.suppress(Exception):
                    await self.write([])

    async def keep_current(self, hooks: list[dict[str, Any]]) -> None:
        """Writes the webhooks again every REASSERT_SECONDS: a configuration replaced or recreated
        while the operator runs (Argo CD's Replace=true, a chart applied again) would otherwise stay
        without them, and admission silently off. An unchanged write changes nothing."""
        while True:
            await asyncio.sleep(REASSERT_SECONDS)
            await self.write(hooks, again=True)

    async def write(self, hooks: list[dict[str, Any]], again: bool = False) -> bool:
        path = f"{CONFIGURATIONS}/{self.configuration}"
        try:
            try:
                await self.client.merge_patch(path, {"webhooks": hooks})
            except ApiError as exc:
                if exc.status != 404:
                    raise
                if not hooks:
                    return False  # nothing to remove (e.g. `helm uninstall` deleted it first)
                body = {"metadata": {"name": self.configuration}, "webhooks": hooks}
                await self.client.create(CONFIGURATIONS, body)
        except (ApiError, aiohttp.ClientError, TimeoutError) as exc:  # e.g. a control-plane upgrade
            if not self.failing:  # said once, not at every write again
                log.error(
                    "cannot write ValidatingWebhookConfiguration %s (%s): no admission webhook; "
                    "the reconciler still refuses invalid specs",
                    self.configuration,
                    exc,
                )
            self.failing = True
            return False
        if not again or self.failing:
            log.info("ValidatingWebhookConfiguration %s: %d webhook(s)", self.configuration, len(hooks))
        self.failing = False
        return True


# An UPDATE review holds two objects of up to 1.5 MiB each (etcd's limit); an InferenceCluster
# carries its spec about three times (the spec, status.appliedSpec, kubectl's last-applied).
MAX_REVIEW_BYTES = 4 * 1024 * 1024


class LargeReviewWebhookServer(kopf.WebhookServer):
    """kopf's webhook server with room for any review the API server sends: aiohttp's default
    1 MiB body limit answered 413 to the UPDATE of a valid ~180 KiB spec, which `Fail` then
    refused (a label change, a finalizer's removal) and `Ignore` let through unjudged."""

    @staticmethod
    async def _serve(fn: Any, request: aiohttp.web.Request) -> aiohttp.web.Response:
        return await kopf.WebhookServer._serve(fn, request.clone(client_max_size=MAX_REVIEW_BYTES))


def configure(settings: kopf.OperatorSettings, config: OperatorConfig, client: KubeClient) -> Path | None:
    """Serve the webhook when a port is configured (otherwise the reconciler still refuses bad specs).
    Returns the mounted serving certificate, if one is used (see `restart_when_changed`)."""
    if config.webhook_port is None:
        return None
    host = config.webhook_host or config.webhook_addr
    # A mounted TLS Secret (tls.crt/tls.key) wins; otherwise a self-signed pair (dev mode).
    if config.webhook_cert_dir:
        directory = Path(config.webhook_cert_dir)
    else:  # the self-signed pair's own folder, gone with the process
        directory = Path(tempfile.mkdtemp(prefix="tessera-webhook-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    certfile, pkeyfile = directory / "tls.crt", directory / "tls.key"
    mounted: Path | None = certfile
    if not certfile.exists():
        certfile, pkeyfile = self_signed(directory, host)
        mounted = None
    server = LargeReviewWebhookServer(
        addr=config.webhook_addr,
        port=config.webhook_port,
        host=host,
        certfile=certfile,
        pkeyfile=pkeyfile,
        cafile=certfile,
    )
    settings.admission.managed = None  # kopf's manager would need cluster-wide `create`
    settings.admission.server = (
        ManagedWebhookServer(
            server,
            config.webhook_managed,
            client,
            config.webhook_service,
            config.webhook_failure_policy,
            config.webhook_namespace_selector,
        )
        if config.webhook_managed
        else server
    )
    return mounted


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:  # a Secret volume swaps its files by symlink: briefly absent
        return None


def _stop_gracefully() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # kopf stops as on any SIGTERM: the webhook is deregistered


# A self-signed pair is made at each start: restarting a week before it expires makes a new one
# (and the managed configuration gets its CA), so the API server never meets an expired one.
SELF_SIGNED_RENEWAL_SECONDS = (SELF_SIGNED_DAYS - 7) * 86400.0


async def restart_to_renew(
    after_s: float = SELF_SIGNED_RENEWAL_SECONDS, stop: Callable[[], None] = _stop_gracefully
) -> None:
    await asyncio.sleep(after_s)
    log.warning("the webhook's self-signed certificate expires in a week: restarting to make a new one")
    stop()


async def restart_when_changed(
    certfile: Path, interval: float = CERT_CHECK_SECONDS, stop: Callable[[], None] = _stop_gracefully
) -> None:
    """kopf's server reads its certificate once: when a renewed one is mounted (cert-manager
    rotates the Secret), stop, and the container restarts serving it, before the old one expires
    and the API server refuses the handshake."""
    serving = _digest(certfile)
    while True:
        await asyncio.sleep(interval)
        current = _digest(certfile)
        if current is not None and current != serving:
            log.warning("the webhook's serving certificate %s changed: restarting to serve it", certfile)
            stop()
            return
