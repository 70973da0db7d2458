"""Operator settings: command-line flags of `tessera-operator`, or environment variables.

The environment form serves `kopf run -m tessera_operator.reconcile.handlers` and tests (short resyncs).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from tessera_operator.admission.podpolicy import DEFAULT_MAX_PODS_PER_CLUSTER, PodPolicy


def _float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


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


def pod_policy_from_environment() -> PodPolicy:
    return PodPolicy(
        allow_host_path=_flag("TESSERA_OPERATOR_ALLOW_HOST_PATH"),
        allow_secrets=_flag("TESSERA_OPERATOR_ALLOW_SECRETS"),
        allowed_secrets=names(os.environ.get("TESSERA_OPERATOR_ALLOWED_SECRETS", "")),
        allowed_service_accounts=names(os.environ.get("TESSERA_OPERATOR_ALLOWED_SERVICE_ACCOUNTS", "")),
        allowed_priority_classes=names(os.environ.get("TESSERA_OPERATOR_ALLOWED_PRIORITY_CLASSES", "")),
        max_pods_per_cluster=_int("TESSERA_OPERATOR_MAX_PODS_PER_CLUSTER", DEFAULT_MAX_PODS_PER_CLUSTER),
        allow_control_plane=_flag("TESSERA_OPERATOR_ALLOW_CONTROL_PLANE"),
    )


@dataclass
class OperatorConfig:
    # Empty: cluster-wide. With `kopf run`, give the same namespaces to kopf's --namespace.
    namespaces: list[str] = field(
        default_factory=lambda: [n for n in os.environ.get("TESSERA_OPERATOR_NAMESPACES", "").split(",") if n]
    )
    resync_seconds: float = field(default_factory=lambda: _float("TESSERA_OPERATOR_RESYNC_SECONDS", 30.0))
    # A cluster is reconciled at most this often on events (its own writes' echoes fold together).
    min_interval_seconds: float = field(default_factory=lambda: _float("TESSERA_OPERATOR_MIN_INTERVAL", 0.5))
    # How often the queue-depth autoscaler samples a cluster's leaders (the HPA's sync period).
    autoscale_interval_seconds: float = field(
        default_factory=lambda: _float("TESSERA_OPERATOR_AUTOSCALE_INTERVAL", 15.0)
    )
    workers: int = field(default_factory=lambda: _int("TESSERA_OPERATOR_WORKERS", 16))
    # Concurrent API requests: the API server's default in-flight limit is 200 mutating.
    concurrency: int = field(default_factory=lambda: _int("TESSERA_OPERATOR_CONCURRENCY", 64))
    kubeconfig: str | None = field(default_factory=lambda: os.environ.get("KUBECONFIG") or None)
    webhook_port: int | None = field(
        default_factory=lambda: (
            int(os.environ["TESSERA_WEBHOOK_PORT"]) if os.environ.get("TESSERA_WEBHOOK_PORT") else None
        )
    )
    webhook_addr: str = field(default_factory=lambda: os.environ.get("TESSERA_WEBHOOK_ADDR", "0.0.0.0"))
    webhook_host: str | None = field(default_factory=lambda: os.environ.get("TESSERA_WEBHOOK_HOST") or None)
    webhook_cert_dir: str | None = field(
        default_factory=lambda: os.environ.get("TESSERA_WEBHOOK_CERT_DIR") or None
    )
    # Name of the ValidatingWebhookConfiguration kopf keeps up to date (None: managed elsewhere, e.g. Helm).
    webhook_managed: str | None = field(
        default_factory=lambda: os.environ.get("TESSERA_WEBHOOK_MANAGED") or None
    )
    # "NAMESPACE/NAME" of the Service in front of the webhook: the managed configuration then names
    # that Service, as the API server expects, instead of a URL it may not resolve (in-cluster DNS).
    webhook_service: str | None = field(
        default_factory=lambda: os.environ.get("TESSERA_WEBHOOK_SERVICE") or None
    )
    # Ignore: an operator that is down (a lost node, an upgrade) must not block every write of
    # an InferenceCluster; the reconciler refuses invalid specs all the same.
    webhook_failure_policy: str = field(
        default_factory=lambda: os.environ.get("TESSERA_WEBHOOK_FAILURE_POLICY", "Ignore")
    )
    # A LabelSelector (JSON) of the namespaces whose objects the API server sends to the webhook.
    webhook_namespace_selector: dict[str, Any] | None = field(
        default_factory=lambda: label_selector(os.environ.get("TESSERA_WEBHOOK_NAMESPACE_SELECTOR", ""))
    )
    # Who may call the webhook: a client certificate the API server presents (an
    # AdmissionConfiguration's kubeConfig for webhooks), signed by this CA bundle and naming one of
    # `webhook_client_names` (CN or a DNS SAN). Without a CA, only `webhook_insecure_skip_client_auth`
    # lets the webhook start: then anyone who reaches its port may send reviews.
    webhook_client_ca: str | None = field(
        default_factory=lambda: os.environ.get("TESSERA_WEBHOOK_CLIENT_CA") or None
    )
    webhook_client_names: frozenset[str] = field(
        default_factory=lambda: names(os.environ.get("TESSERA_WEBHOOK_CLIENT_NAMES", ""))
    )
    webhook_insecure_skip_client_auth: bool = field(
        default_factory=lambda: _flag("TESSERA_WEBHOOK_INSECURE_SKIP_CLIENT_AUTH")
    )
    # Reviews judged at once; more are answered 429 at once (each holds its body, up to
    # webhook.MAX_REVIEW_BYTES, and may make two dry-run pod creates).
    webhook_max_in_flight: int = field(default_factory=lambda: _int("TESSERA_WEBHOOK_MAX_IN_FLIGHT", 4))
    # What a spec may put into rank pods (hostPath, Secrets, ServiceAccounts, ...) and the pod cap.
    pod_policy: PodPolicy = field(default_factory=pod_policy_from_environment)


CONFIG = OperatorConfig()
