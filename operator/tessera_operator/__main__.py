"""`tessera-operator`: run the InferenceCluster operator (namespace-scoped or cluster-wide)."""

from __future__ import annotations

import argparse
import logging
import os

import kopf

from tessera_operator.admission import webhook
from tessera_operator.config import CONFIG
from tessera_operator.flags import add_config_flags, add_model_flags, config_from_args
from tessera_operator.leadership import settings as leader_settings
from tessera_operator.reconcile import handlers  # importing registers the kopf handlers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The settings' flags (from config.py) and the process's own: scope, liveness, verbosity."""
    parser = argparse.ArgumentParser(prog="tessera-operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch the whole cluster")
    parser.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz", help="health endpoint URL ('' to disable)"
    )
    add_config_flags(parser, CONFIG, scope)
    election = leader_settings.from_env()
    add_model_flags(parser, election, {"": parser.add_argument_group((type(election).__doc__ or "").strip())})
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
    settings = config_from_args(args, CONFIG)
    namespaces = [] if args.all_namespaces else list(args.namespaces) or list(CONFIG.namespaces)
    if not namespaces and not args.all_namespaces:  # kopf would quietly watch every namespace
        raise SystemExit("tessera-operator: name the namespaces to watch (-n NAMESPACE) or pass -A")
    for name, value in {**settings, "namespaces": namespaces}.items():
        setattr(CONFIG, name, value)
    if CONFIG.webhook_port is not None:
        problem = webhook.client_auth_problem(CONFIG)
        if problem:
            raise SystemExit(f"tessera-operator: {problem}")
    if CONFIG.webhook_port is not None:
        webhook.register()
    try:  # leader election (handlers reads it at startup)
        handlers.LEADER_ELECTION = leader_settings.LeaderElection(
            **{name: getattr(args, name) for name in leader_settings.LeaderElection.model_fields}
        )
    except ValueError as exc:  # pydantic's ValidationError is one
        raise SystemExit(f"tessera-operator: {exc}") from None
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's watches use the same identity as our client
    kopf.run(
        # No kopf peering: with --leader-elect, a Lease decides which replica reconciles (leadership/).
        standalone=True,
        clusterwide=args.all_namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
