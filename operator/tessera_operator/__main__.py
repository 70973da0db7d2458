"""`tessera-operator`: run the InferenceCluster operator (namespace-scoped or cluster-wide)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import kopf

from tessera_operator.admission import webhook
from tessera_operator.admission.podpolicy import PodPolicy
from tessera_operator.config import CONFIG, label_selector, names
from tessera_operator.reconcile import handlers  # noqa: F401  (importing registers the kopf handlers)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


def selector(text: str) -> dict[str, Any] | None:
    try:
        return label_selector(text)
    except ValueError as exc:  # json's errors are ValueErrors too
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tessera-operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable; default: $TESSERA_OPERATOR_NAMESPACES, comma-separated)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch the whole cluster")
    parser.add_argument("--kubeconfig", default=CONFIG.kubeconfig, help="default: $KUBECONFIG or in-cluster")
    parser.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz", help="health endpoint URL ('' to disable)"
    )
    parser.add_argument(
        "--workers", type=positive_int, default=CONFIG.workers, help="clusters reconciled at once"
    )
    parser.add_argument(
        "--concurrency", type=positive_int, default=CONFIG.concurrency, help="API requests in flight"
    )
    parser.add_argument("--resync-seconds", type=positive_float, default=CONFIG.resync_seconds)
    parser.add_argument(
        "--min-interval",
        type=float,
        default=CONFIG.min_interval_seconds,
        help="seconds between passes per cluster",
    )
    parser.add_argument(
        "--autoscale-interval",
        type=positive_float,
        default=CONFIG.autoscale_interval_seconds,
        help="seconds between queue-depth samples of an autoscaled cluster",
    )
    parser.add_argument("--webhook-port", type=int, default=CONFIG.webhook_port, help="serve the webhook")
    parser.add_argument("--webhook-addr", default=CONFIG.webhook_addr)
    parser.add_argument("--webhook-host", default=CONFIG.webhook_host, help="hostname the API server calls")
    parser.add_argument("--webhook-cert-dir", default=CONFIG.webhook_cert_dir, help="tls.crt + tls.key")
    parser.add_argument(
        "--webhook-service",
        default=CONFIG.webhook_service,
        metavar="NAMESPACE/NAME",
        help="the managed configuration calls this Service (in a cluster) instead of the host's URL",
    )
    parser.add_argument(
        "--webhook-failure-policy",
        choices=("Fail", "Ignore"),
        default=CONFIG.webhook_failure_policy,
        help="what the API server does when the managed webhook cannot be reached",
    )
    parser.add_argument(
        "--webhook-namespace-selector",
        type=selector,
        default=CONFIG.webhook_namespace_selector,
        metavar="JSON",
        help='LabelSelector of the namespaces the managed webhook sees, e.g. {"matchLabels": {"team": "a"}}',
    )
    parser.add_argument(
        "--webhook-managed",
        default=CONFIG.webhook_managed,
        help="name of the ValidatingWebhookConfiguration the operator keeps current (the chart creates it)",
    )
    auth = parser.add_argument_group(
        "who may call the webhook (one of --webhook-client-ca or --webhook-insecure-skip-client-auth)"
    )
    auth.add_argument(
        "--webhook-client-ca",
        default=CONFIG.webhook_client_ca,
        metavar="FILE",
        help="CA bundle (PEM) that signs the client certificate the API server presents to webhooks "
        "(its AdmissionConfiguration's kubeConfig); a review without such a certificate is refused",
    )
    auth.add_argument(
        "--webhook-client-names",
        type=names,
        default=CONFIG.webhook_client_names,
        metavar="A,B",
        help="the names (CN or DNS SAN) that certificate may carry (required with --webhook-client-ca)",
    )
    auth.add_argument(
        "--webhook-insecure-skip-client-auth",
        action="store_true",
        default=CONFIG.webhook_insecure_skip_client_auth,
        help="INSECURE: take reviews from anyone who reaches the port, for API servers that present "
        "no client certificate (managed clusters)",
    )
    auth.add_argument(
        "--webhook-max-in-flight",
        type=positive_int,
        default=CONFIG.webhook_max_in_flight,
        help="reviews judged at once; more are answered 429 at once",
    )
    policy = CONFIG.pod_policy
    pods = parser.add_argument_group("what an InferenceCluster may put into its pods (default: nothing)")
    pods.add_argument(
        "--allow-host-path", action="store_true", default=policy.allow_host_path, help="hostPath volumes"
    )
    pods.add_argument(
        "--allow-secrets",
        "--allow-secret-env",
        action="store_true",
        default=policy.allow_secrets,
        help="env valueFrom.secretKeyRef, secret and projected-secret volumes, of any Secret",
    )
    pods.add_argument(
        "--allowed-secrets",
        type=names,
        default=policy.allowed_secrets,
        metavar="A,B",
        help="these Secrets only, in the same places (e.g. the API key's): the rest stay refused",
    )
    pods.add_argument(
        "--allowed-service-accounts",
        type=names,
        default=policy.allowed_service_accounts,
        metavar="A,B",
        help="ServiceAccounts a spec may name (rank pods still mount no token unless it projects one)",
    )
    pods.add_argument(
        "--allowed-priority-classes", type=names, default=policy.allowed_priority_classes, metavar="A,B"
    )
    pods.add_argument(
        "--max-pods-per-cluster",
        type=positive_int,
        default=policy.max_pods_per_cluster,
        help="cap on (max(replicas, autoscaling.maxReplicas) + maxSurge) x tensor x pipeline of a cluster",
    )
    pods.add_argument(
        "--allow-control-plane",
        action="store_true",
        default=policy.allow_control_plane,
        help="nodeSelector, node affinity and tolerations that place rank pods on control-plane nodes",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # kopf logs every handled event at INFO; our own log says what changed
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    CONFIG.kubeconfig = args.kubeconfig
    namespaces = [] if args.all_namespaces else list(args.namespace) or list(CONFIG.namespaces)
    if not namespaces and not args.all_namespaces:  # kopf would quietly watch every namespace
        raise SystemExit("tessera-operator: name the namespaces to watch (-n NAMESPACE) or pass -A")
    CONFIG.namespaces = namespaces
    CONFIG.workers = args.workers
    CONFIG.concurrency = args.concurrency
    CONFIG.resync_seconds = args.resync_seconds
    CONFIG.min_interval_seconds = args.min_interval
    CONFIG.autoscale_interval_seconds = args.autoscale_interval
    CONFIG.webhook_port = args.webhook_port
    CONFIG.webhook_addr = args.webhook_addr
    CONFIG.webhook_host = args.webhook_host
    CONFIG.webhook_cert_dir = args.webhook_cert_dir
    CONFIG.webhook_managed = args.webhook_managed
    CONFIG.webhook_service = args.webhook_service
    CONFIG.webhook_failure_policy = args.webhook_failure_policy
    CONFIG.webhook_namespace_selector = args.webhook_namespace_selector
    CONFIG.webhook_client_ca = args.webhook_client_ca
    CONFIG.webhook_client_names = frozenset(args.webhook_client_names)
    CONFIG.webhook_insecure_skip_client_auth = args.webhook_insecure_skip_client_auth
    CONFIG.webhook_max_in_flight = args.webhook_max_in_flight
    if CONFIG.webhook_port is not None:
        problem = webhook.client_auth_problem(CONFIG)
        if problem:
            raise SystemExit(f"tessera-operator: {problem}")
    CONFIG.pod_policy = PodPolicy(
        allow_host_path=args.allow_host_path,
        allow_secrets=args.allow_secrets,
        allowed_secrets=frozenset(args.allowed_secrets),
        allowed_service_accounts=frozenset(args.allowed_service_accounts),
        allowed_priority_classes=frozenset(args.allowed_priority_classes),
        max_pods_per_cluster=args.max_pods_per_cluster,
        allow_control_plane=args.allow_control_plane,
    )
    if CONFIG.webhook_port is not None:
        webhook.register()
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's watches use the same identity as our client
    kopf.run(
        standalone=True,  # one replica (Recreate strategy); no peering objects needed
        clusterwide=args.all_namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
