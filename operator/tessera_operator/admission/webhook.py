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

Only the API server may call it (`GuardedWebhookServer`): its TLS handshake requires a client
certificate signed by `--webhook-client-ca` and naming one of `--webhook-client-names` (the API
server presents one when its AdmissionConfiguration gives webhooks a kubeConfig), unless the
operator runs with `--webhook-insecure-skip-client-auth`. A review is judged only within bounds:
MAX_REVIEW_BYTES read at most, `--webhook-max-in-flight` at once (more answered 429 at once), and
MAX_REVIEW_DEPTH levels of nesting (deeper ones, even too deep for Python's JSON decoder, are
denied naming the problem). A dry run of pods is made only in a namespace the operator watches.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import ssl
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import aiohttp.web
import kopf
from kopf._core.engines import admission  # the errors kopf's own server maps to HTTP (pinned kopf)

from tessera_operator import api
from tessera_operator.admission.certs import SELF_SIGNED_DAYS, self_signed
from tessera_operator.admission.pod_dry_run import refused_pod_fields
from tessera_operator.admission.validation import validate_object
from tessera_operator.bounded_json import describe, excess
from tessera_operator.builders import ClusterRef, revision_of
from tessera_operator.config import CONFIG, OperatorConfig
from tessera_operator.fielderror import FieldError
from tessera_operator.kube import ApiError, KubeClient

log = logging.getLogger("tessera_operator.admission.webhook")
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
    namespace = (body.get("metadata") or {}).get("namespace") or namespace
    generate_name = (body.get("metadata") or {}).get("generateName")
    name = name or (generate_name + GENERATED_SUFFIX if generate_name else "generated")
    errors = validate_object(name, dict(spec), CONFIG.pod_policy)
    client = (memo or {}).get("client")
    # The API server's own verdict on the pods it would make; asked only where the operator serves
    # (its `pods/create` there is what the author borrows), never for a review naming no namespace.
    if not errors and client is not None and namespace and may_dry_run(namespace, CONFIG.namespaces):
        errors = await pod_errors(client, name, namespace, body, spec)
    if errors:
        raise kopf.AdmissionError("; ".join(str(e) for e in errors), code=422)


def may_dry_run(namespace: str, namespaces: list[str]) -> bool:
    """Whether the operator serves `namespace` (all of them when it watches the whole cluster)."""
    return not namespaces or namespace in namespaces


async def pod_errors(client: KubeClient, name: str, namespace: str, body: Any, spec: Any) -> list[FieldError]:
    meta = body.get("metadata") or {}
    ref = ClusterRef(name, namespace, meta.get("uid") or "")
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


# An UPDATE review holds two objects; etcd keeps one of at most 1.5 MiB by default, and an
# InferenceCluster carries its spec about three times (the spec, status.appliedSpec, kubectl's
# last-applied), so a valid spec of ~250 KiB still fits. aiohttp's default of 1 MiB answered 413
# to the UPDATE of a valid ~180 KiB spec.
MAX_REVIEW_BYTES = 3 * 1024 * 1024
# A valid object nests about 45 levels at most (a free-form field's 32 under spec.template, or its
# managedFields); kopf's own handling and Python's recursive walks fail some hundreds deeper.
MAX_REVIEW_DEPTH = 100
DEFAULT_MAX_IN_FLIGHT = 4
READ_TIMEOUT_S = 10.0  # the API server waits timeoutSeconds (10) for the whole answer anyway
# The AdmissionReview's own fields come first (Go writes struct fields in order): a review too deep
# to decode still says its version and uid, so its denial reaches the user.
_VERSION_RE = re.compile(r'"apiVersion"\s*:\s*"(admission\.k8s\.io/v1(?:beta1)?)"')
_UID_RE = re.compile(r'"uid"\s*:\s*"([-0-9a-zA-Z]{1,128})"')
_HEAD = 4096  # where those fields are looked for
FREE_FORM_FIELDS = (
    "the free-form fields (spec.template.affinity, tolerations, volumes, volumeMounts, resources, "
    "env[].valueFrom)"
)


def client_auth_problem(config: OperatorConfig) -> str | None:
    """Why the webhook must not start with this configuration: it must know who may call it."""
    if config.webhook_client_ca:
        if not config.webhook_client_names:
            return (
                "--webhook-client-ca needs --webhook-client-names: the CN or DNS SAN of the client "
                "certificate the API server presents (a cluster CA signs every user's too)"
            )
        if not Path(config.webhook_client_ca).is_file():
            return f"--webhook-client-ca {config.webhook_client_ca}: no such file"
        return None
    if config.webhook_insecure_skip_client_auth:
        return None
    return (
        "the webhook (--webhook-port) takes reviews from the API server only: give "
        "--webhook-client-ca FILE and --webhook-client-names NAME (the client certificate the API "
        "server presents to webhooks; see docs/SECURITY.md), or --webhook-insecure-skip-client-auth "
        "where the API server cannot present one"
    )


def peer_names(peercert: Any) -> set[str]:
    """The CN and DNS SANs of a verified peer certificate (ssl's getpeercert() form)."""
    found: set[str] = set()
    for rdn in (peercert or {}).get("subject", ()):
        found |= {value for key, value in rdn if key == "commonName"}
    found |= {value for kind, value in (peercert or {}).get("subjectAltName", ()) if kind == "DNS"}
    return found


def denial(version: str, uid: str, message: str, code: int = 422) -> dict[str, Any]:
    return {
        "apiVersion": version,
        "kind": "AdmissionReview",
        "response": {"uid": uid, "allowed": False, "status": {"code": code, "message": message}},
    }


def _plain(status: int, reason: str, **headers: str) -> aiohttp.web.Response:
    return aiohttp.web.Response(status=status, text=reason + "\n", headers=headers)


def _field(path: list[str | int]) -> str:
    """A path in the review as kubectl names the field: `spec.template.affinity...`."""
    where = path[2:] if path[:2] == ["request", "object"] else path
    return describe(where, limit=4).lstrip(".")


class GuardedWebhookServer(kopf.WebhookServer):
    """kopf's webhook server, for the API server only, judging each review within bounds.

    - Who: with `client_names`, the TLS context (`verify_cafile`, `verify_mode=CERT_REQUIRED`) has
      refused a client without a certificate of that CA; a certificate of another name (a user's,
      signed by the same cluster CA) is answered 403.
    - How many: `max_in_flight` reviews at once; one more is answered 429 before its body is read.
    - How large: a body over MAX_REVIEW_BYTES is answered 413, read only as far as that.
    - How deep: a review Python cannot decode (RecursionError), or whose object nests deeper than
      MAX_REVIEW_DEPTH, is denied with a message saying so (an object being deleted passes).
    """

    def __init__(
        self,
        *,
        client_names: frozenset[str] = frozenset(),
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.client_names = client_names
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    async def _serve(  # type: ignore[override]  # kopf calls it as self._serve(fn, request)
        self, fn: Any, request: aiohttp.web.Request
    ) -> aiohttp.web.Response:
        if self.client_names:
            peercert = request.transport.get_extra_info("peercert") if request.transport else None
            if not peercert:
                return _plain(401, "a client certificate is required")
            if not peer_names(peercert) & self.client_names:
                return _plain(403, "this client certificate may not send admission reviews")
        if self.in_flight >= self.max_in_flight:
            return _plain(429, "too many admission reviews at once", **{"Retry-After": "1"})
        self.in_flight += 1
        try:
            return await self._judge(fn, request)
        finally:
            self.in_flight -= 1

    async def _judge(self, fn: Any, request: aiohttp.web.Request) -> aiohttp.web.Response:
        too_large = f"an AdmissionReview takes at most {MAX_REVIEW_BYTES} bytes"
        if (request.content_length or 0) > MAX_REVIEW_BYTES:
            return _plain(413, too_large)
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):  # a slow sender must not hold a slot for long
                raw = await request.clone(client_max_size=MAX_REVIEW_BYTES).read()
        except aiohttp.web.HTTPRequestEntityTooLarge:
            return _plain(413, too_large)
        except TimeoutError:
            return _plain(408, f"the AdmissionReview did not arrive within {READ_TIMEOUT_S:g} s")
        try:
            text = raw.decode("utf-8")
            review = json.loads(text)
        except RecursionError:
            return self._too_deep_to_decode(text)
        except ValueError as exc:  # not UTF-8, not JSON
            return _plain(400, f"not an AdmissionReview: {exc}")
        if not isinstance(review, dict) or not isinstance(review.get("request"), dict):
            return _plain(400, "not an AdmissionReview: no request")
        refused = self._bounded(review)
        if refused is not None:
            return aiohttp.web.json_response(refused)
        # The rest as kopf's own `_serve` does it, on the review decoded here.
        sslpeer = request.transport.get_extra_info("peercert") if request.transport else None
        try:
            answer = await fn(
                review, webhook=request.match_info.get("id"), sslpeer=sslpeer, headers=dict(request.headers)
            )
        except admission.AmbiguousResourceError as exc:
            raise aiohttp.web.HTTPConflict(reason=str(exc) or None) from exc
        except admission.UnknownResourceError as exc:
            raise aiohttp.web.HTTPNotFound(reason=str(exc) or None) from exc
        except admission.WebhookError as exc:
            raise aiohttp.web.HTTPBadRequest(reason=str(exc) or None) from exc
        return aiohttp.web.json_response(answer)

    @staticmethod
    def _too_deep_to_decode(text: str) -> aiohttp.web.Response:
        head = text[:_HEAD]
        version, uid = _VERSION_RE.search(head), _UID_RE.search(head)
        if uid is None:
            return _plain(400, "an AdmissionReview nested too deeply to decode, without a request uid")
        message = (
            f"the object nests too deeply to be judged (deeper than the operator's JSON decoder takes, "
            f"about {sys.getrecursionlimit()} levels): {FREE_FORM_FIELDS} may nest at most "
            f"{api.MAX_FREE_FORM_DEPTH} levels"
        )
        log.warning("denied review %s: %s", uid.group(1), message)
        answer = denial(version.group(1) if version else "admission.k8s.io/v1", uid.group(1), message)
        return aiohttp.web.json_response(answer)

    @staticmethod
    def _bounded(review: dict[str, Any]) -> dict[str, Any] | None:
        """A denial for an object nested deeper than MAX_REVIEW_DEPTH, else None (the review is
        normalised on the way: the request's namespace written into an object that lacks it, an
        old object too deep to compare dropped, so that the new spec is judged whole)."""
        request = review["request"]
        obj = request.get("object") if isinstance(request.get("object"), dict) else None
        if excess(request.get("oldObject"), MAX_REVIEW_DEPTH - 2, 2**62) is not None:
            request["oldObject"] = None
        found = excess(review, MAX_REVIEW_DEPTH, 2**62)
        if found is not None:
            deleting = obj is not None and (obj.get("metadata") or {}).get("deletionTimestamp")
            if request.get("operation") not in OPERATIONS or deleting:
                return {
                    "apiVersion": review.get("apiVersion") or "admission.k8s.io/v1",
                    "kind": "AdmissionReview",
                    "response": {"uid": request.get("uid", ""), "allowed": True},
                }  # what the handler would answer: such writes always pass
            message = (
                f"{_field(found[1])}: nests deeper than {MAX_REVIEW_DEPTH} levels; "
                f"{FREE_FORM_FIELDS} may nest at most {api.MAX_FREE_FORM_DEPTH} levels"
            )
            return denial(
                review.get("apiVersion") or "admission.k8s.io/v1", str(request.get("uid", "")), message
            )
        if obj is not None and isinstance(obj.get("metadata"), dict) and request.get("namespace"):
            obj["metadata"].setdefault("namespace", request["namespace"])
        return None


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
    if config.webhook_client_ca:
        verify: dict[str, Any] = {"verify_cafile": config.webhook_client_ca, "verify_mode": ssl.CERT_REQUIRED}
        log.info(
            "the webhook takes reviews from clients with a certificate of %s naming %s",
            config.webhook_client_ca,
            ", ".join(sorted(config.webhook_client_names)),
        )
    else:
        verify = {}
        log.warning(
            "INSECURE: the webhook takes reviews from anyone who reaches port %s "
            "(--webhook-insecure-skip-client-auth): each may cost dry-run pod creates",
            config.webhook_port,
        )
    server = GuardedWebhookServer(
        addr=config.webhook_addr,
        port=config.webhook_port,
        host=host,
        certfile=certfile,
        pkeyfile=pkeyfile,
        cafile=certfile,
        client_names=config.webhook_client_names if config.webhook_client_ca else frozenset(),
        max_in_flight=config.webhook_max_in_flight,
        **verify,
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
