"""Operator settings, declared once: `tessera-operator`'s flags are generated from these fields
(`flags.py`: names from field names or `flag`, help from descriptions, types, choices and
defaults from the fields), and each field's `env` variable gives its default.

The environment form serves `kopf run -m tessera_operator.reconcile.handlers` and tests (short
resyncs). `PodPolicy()` alone is the strict default; the environment reaches it through
`OperatorConfig`.
"""

from __future__ import annotations

import json
import os
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from tessera.engine.arg_utils import base_type

DEFAULT_MAX_PODS_PER_CLUSTER = 1024
AUTH_GROUP = "who may call the webhook (one of --webhook-client-ca or --webhook-insecure-skip-client-auth)"


def names(text: str) -> frozenset[str]:
    """`a,b` -> {a, b} (flags and environment variables list names this way)."""
    return frozenset(n.strip() for n in text.split(",") if n.strip())


def label_selector(text: str) -> dict[str, Any] | None:
    """A LabelSelector from JSON (`{"matchLabels": {...}}`); empty text or `{}`: None (all)."""
    if not text.strip():
        return None
    selector = json.loads(text)
    if not isinstance(selector, dict) or set(selector) - {"matchLabels", "matchExpressions"}:
        raise ValueError(f"not a LabelSelector (matchLabels, matchExpressions): {text}")
    return selector or None


def setting(default: Any, description: str = "", env: str | None = None, **cli: Any) -> Any:
    """A field with its environment variable and, in `cli`, what its flag needs beyond the field:
    `flag` (another name), `aliases`, `short`, `metavar`, `group`, `positive`, `scoped`."""
    return Field(default, description=description, json_schema_extra={"env": env, **cli})


class PodPolicy(BaseModel):
    """what an InferenceCluster may put into its pods (default: nothing)"""

    model_config = ConfigDict(frozen=True)

    allow_host_path: bool = setting(False, "hostPath volumes", "TESSERA_OPERATOR_ALLOW_HOST_PATH")
    allow_secrets: bool = setting(
        False,
        "env valueFrom.secretKeyRef, secret and projected-secret volumes, of any Secret",
        "TESSERA_OPERATOR_ALLOW_SECRETS",
        aliases=["--allow-secret-env"],
    )
    allowed_secrets: frozenset[str] = setting(
        frozenset(),
        "these Secrets only, in the same places (e.g. the API key's): the rest stay refused",
        "TESSERA_OPERATOR_ALLOWED_SECRETS",
    )
    allowed_service_accounts: frozenset[str] = setting(
        frozenset(),
        "ServiceAccounts a spec may name (rank pods still mount no token unless it projects one)",
        "TESSERA_OPERATOR_ALLOWED_SERVICE_ACCOUNTS",
    )
    allowed_priority_classes: frozenset[str] = setting(
        frozenset(), "", "TESSERA_OPERATOR_ALLOWED_PRIORITY_CLASSES"
    )
    max_pods_per_cluster: int = setting(
        DEFAULT_MAX_PODS_PER_CLUSTER,
        "cap on (max(replicas, autoscaling.maxReplicas) + maxSurge) x tensor x pipeline of a cluster",
        "TESSERA_OPERATOR_MAX_PODS_PER_CLUSTER",
        positive=True,
    )
    allow_control_plane: bool = setting(
        False,
        "nodeSelector, node affinity and tolerations that place rank pods on control-plane nodes",
        "TESSERA_OPERATOR_ALLOW_CONTROL_PLANE",
    )

    def secret_allowed(self, name: object) -> bool:
        return self.allow_secrets or (isinstance(name, str) and name in self.allowed_secrets)


class OperatorConfig(BaseModel):
    """Fields not given take their environment variable, else their default."""

    namespaces: list[str] = setting(
        [],
        "watch this namespace (repeatable; default: $TESSERA_OPERATOR_NAMESPACES, comma-separated)",
        "TESSERA_OPERATOR_NAMESPACES",  # empty: cluster-wide; with `kopf run`, give kopf's --namespace too
        flag="--namespace",
        short="-n",
        metavar="NAMESPACE",
        scoped=True,  # beside --all-namespaces: one or the other
    )
    kubeconfig: str | None = setting(None, "default: $KUBECONFIG or in-cluster", "KUBECONFIG")
    workers: int = setting(16, "clusters reconciled at once", "TESSERA_OPERATOR_WORKERS", positive=True)
    # The API server's default in-flight limit is 200 mutating.
    concurrency: int = setting(64, "API requests in flight", "TESSERA_OPERATOR_CONCURRENCY", positive=True)
    resync_seconds: float = setting(30.0, "", "TESSERA_OPERATOR_RESYNC_SECONDS", positive=True)
    # A cluster is reconciled at most this often on events (its own writes' echoes fold together).
    min_interval_seconds: float = setting(
        0.5,
        "seconds between passes per cluster",
        "TESSERA_OPERATOR_MIN_INTERVAL",
        flag="--min-interval",
        metavar="MIN_INTERVAL",
    )
    # The HPA's sync period.
    autoscale_interval_seconds: float = setting(
        15.0,
        "seconds between queue-depth samples of an autoscaled cluster",
        "TESSERA_OPERATOR_AUTOSCALE_INTERVAL",
        flag="--autoscale-interval",
        metavar="AUTOSCALE_INTERVAL",
        positive=True,
    )
    webhook_port: int | None = setting(None, "serve the webhook", "TESSERA_WEBHOOK_PORT")
    webhook_addr: str = setting("0.0.0.0", "", "TESSERA_WEBHOOK_ADDR")
    webhook_host: str | None = setting(None, "hostname the API server calls", "TESSERA_WEBHOOK_HOST")
    webhook_cert_dir: str | None = setting(None, "tls.crt + tls.key", "TESSERA_WEBHOOK_CERT_DIR")
    # None: the configuration is managed elsewhere, e.g. by Helm.
    webhook_managed: str | None = setting(
        None,
        "name of the ValidatingWebhookConfiguration the operator keeps current (the chart creates it)",
        "TESSERA_WEBHOOK_MANAGED",
    )
    # The managed configuration then names that Service, as the API server expects, instead of
    # a URL it may not resolve (in-cluster DNS).
    webhook_service: str | None = setting(
        None,
        "the managed configuration calls this Service (in a cluster) instead of the host's URL",
        "TESSERA_WEBHOOK_SERVICE",
        metavar="NAMESPACE/NAME",
    )
    # Ignore: an operator that is down (a lost node, an upgrade) must not block every write of
    # an InferenceCluster; the reconciler refuses invalid specs all the same.
    webhook_failure_policy: Literal["Fail", "Ignore"] = setting(
        "Ignore",
        "what the API server does when the managed webhook cannot be reached",
        "TESSERA_WEBHOOK_FAILURE_POLICY",
    )
    webhook_namespace_selector: dict[str, Any] | None = setting(
        None,
        'LabelSelector of the namespaces the managed webhook sees, e.g. {"matchLabels": {"team": "a"}}',
        "TESSERA_WEBHOOK_NAMESPACE_SELECTOR",
        metavar="JSON",
    )
    # Who may call the webhook: a client certificate the API server presents, signed by this CA
    # bundle and naming one of `webhook_client_names` (CN or a DNS SAN). Without a CA, only
    # `webhook_insecure_skip_client_auth` lets the webhook start: then anyone who reaches its
    # port may send reviews.
    webhook_client_ca: str | None = setting(
        None,
        "CA bundle (PEM) that signs the client certificate the API server presents to webhooks "
        "(its AdmissionConfiguration's kubeConfig); a review without such a certificate is refused",
        "TESSERA_WEBHOOK_CLIENT_CA",
        metavar="FILE",
        group=AUTH_GROUP,
    )
    webhook_client_names: frozenset[str] = setting(
        frozenset(),
        "the names (CN or DNS SAN) that certificate may carry (required with --webhook-client-ca)",
        "TESSERA_WEBHOOK_CLIENT_NAMES",
        group=AUTH_GROUP,
    )
    webhook_insecure_skip_client_auth: bool = setting(
        False,
        "INSECURE: take reviews from anyone who reaches the port, for API servers that present "
        "no client certificate (managed clusters)",
        "TESSERA_WEBHOOK_INSECURE_SKIP_CLIENT_AUTH",
        group=AUTH_GROUP,
    )
    # Each review holds its body (up to webhook.MAX_REVIEW_BYTES) and may make two dry-run creates.
    webhook_max_in_flight: int = setting(
        4,
        "reviews judged at once; more are answered 429 at once",
        "TESSERA_WEBHOOK_MAX_IN_FLIGHT",
        positive=True,
        group=AUTH_GROUP,
    )
    # What a spec may put into rank pods (hostPath, Secrets, ServiceAccounts, ...) and the pod cap.
    pod_policy: PodPolicy = Field(default_factory=PodPolicy)

    @model_validator(mode="before")
    @classmethod
    def _environment(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        values = {**from_environment(cls, os.environ), **values}
        if "pod_policy" not in values:
            values["pod_policy"] = PodPolicy(**from_environment(PodPolicy, os.environ))
        return values


def extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def from_text(field: FieldInfo, text: str) -> Any:
    """A field's value from its environment variable (or a flag's text)."""
    kind = base_type(field.annotation)
    origin = typing.get_origin(kind)
    if kind is bool:
        return text.strip().lower() in ("1", "true", "yes")
    if origin is frozenset:
        return names(text)
    if origin is list:
        return [n for n in text.split(",") if n]
    if origin is dict:
        return label_selector(text)
    if kind in (int, float):
        return kind(text)
    return text


def from_environment(model: type[BaseModel], environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields whose variable is set; an empty one leaves an optional field None."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        env = extra(field).get("env")
        if not env or env not in environ:
            continue
        text = environ[env]
        if not text and base_type(field.annotation) is not field.annotation:
            continue
        values[name] = from_text(field, text)
    return values


CONFIG = OperatorConfig()
