"""`tessera router [options]`: the flags, then the server (docs/router.md)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from tessera.engine.arg_utils import parse_size


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TESSERA_ROUTER_PORT", "8000")))
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    where = parser.add_argument_group("endpoints (the group leaders)")
    where.add_argument(
        "--endpoint", action="append", default=[], metavar="URL", help="a leader's base URL (repeatable)"
    )
    where.add_argument(
        "--endpoints-file",
        type=Path,
        default=None,
        help="a file of leader base URLs, one per line (# comments), re-read every --reload-interval "
        "seconds (e.g. a mounted ConfigMap): a URL removed gets no new requests, its open ones finish",
    )
    where.add_argument("--reload-interval", type=float, default=1.0, help="seconds (default: 1)")
    where.add_argument(
        "--kube-cluster",
        default=None,
        metavar="NAME",
        help="follow the Ready leader pods of this InferenceCluster through the Kubernetes API instead",
    )
    where.add_argument(
        "--kube-namespace", default=None, help="its namespace (default: the pod's own, else default)"
    )
    where.add_argument(
        "--upstream-port",
        type=int,
        default=8000,
        help="the leaders' API port with --kube-cluster (default: 8000)",
    )
    score = parser.add_argument_group("scoring (docs/router.md)")
    score.add_argument(
        "--model",
        default=None,
        help="the served model's tokenizer (alias or Hugging Face folder), for prefix-aware routing; "
        "without it requests are routed on load and session affinity only",
    )
    score.add_argument("--block-size", type=int, default=16, help="the leaders' --block-size (default: 16)")
    score.add_argument("--prefix-weight", type=float, default=4.0)
    score.add_argument("--affinity-weight", type=float, default=2.0)
    score.add_argument("--load-weight", type=float, default=1.0)
    score.add_argument("--kv-weight", type=float, default=2.0)
    score.add_argument(
        "--busy-queue",
        type=int,
        default=8,
        help="an endpoint with this many requests waiting loses its prefix and affinity advantage (default: 8)",
    )
    score.add_argument("--session-header", default="x-session-id", help="(default: x-session-id)")
    score.add_argument(
        "--prefix-index-entries",
        type=int,
        default=100_000,
        help="block hashes remembered (~190 B each; default: 100000)",
    )
    score.add_argument("--session-entries", type=int, default=100_000, help="sessions remembered")
    score.add_argument(
        "--poll-interval", type=float, default=1.0, help="seconds between load polls (default: 1)"
    )
    faults = parser.add_argument_group("faults and limits")
    faults.add_argument(
        "--hold-max",
        type=int,
        default=0,
        help="with no endpoint Ready, hold up to this many requests until one is (default: 0, a 503 at once)",
    )
    faults.add_argument(
        "--hold-timeout", type=float, default=30.0, help="seconds a request is held (default: 30)"
    )
    faults.add_argument(
        "--retry-after", type=int, default=1, help="a 503's Retry-After, seconds (default: 1)"
    )
    faults.add_argument(
        "--max-body-size",
        type=parse_size,
        default=16 * 1024 * 1024,
        help="larger bodies get 413 (default: 16MiB)",
    )


def run_router(args: argparse.Namespace) -> int:
    from aiohttp import web

    from tessera.router.app import Router, RouterSettings
    from tessera.router.endpoints import EndpointsFileError, EndpointSource, StaticEndpointSource
    from tessera.router.scorer import ScoreWeights

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger = logging.getLogger("tessera.router")
    source: EndpointSource
    if args.kube_cluster is not None:
        if args.endpoint or args.endpoints_file:
            logger.error("--kube-cluster excludes --endpoint and --endpoints-file: give one source")
            return 2
        from tessera.router.kube_source import KubernetesEndpointSource, default_namespace

        source = KubernetesEndpointSource(
            args.kube_cluster, args.kube_namespace or default_namespace(), args.upstream_port
        )
    else:
        try:
            source = StaticEndpointSource(args.endpoint, args.endpoints_file, args.reload_interval)
        except EndpointsFileError as exc:
            logger.error("%s", exc)
            return 2
    hasher = None
    if args.model is not None:
        from tessera.router.prompt_hashes import PromptHasher

        hasher = PromptHasher(args.model, args.block_size)
    weights = ScoreWeights(
        args.prefix_weight, args.affinity_weight, args.load_weight, args.kv_weight, args.busy_queue
    )
    settings = RouterSettings(
        session_header=args.session_header,
        max_body_size=args.max_body_size,
        retry_after_s=args.retry_after,
        poll_interval_s=args.poll_interval,
        weights=weights,
        prefix_index_entries=args.prefix_index_entries,
        session_entries=args.session_entries,
        hold_max=args.hold_max,
        hold_timeout_s=args.hold_timeout,
    )
    app = Router(settings, source, hasher).build_app()
    logger.info(
        "routing on http://%s:%d (prefix scoring %s, hold %s)",
        args.host,
        args.port,
        f"on, {args.model}" if hasher else "off (no --model)",
        f"up to {args.hold_max} for {args.hold_timeout:g} s" if args.hold_max else "off",
    )
    # handler_cancellation: a client that leaves cancels its handler, which closes the leader's
    # connection, so the leader aborts the request instead of generating for no one.
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, access_log=None, print=None)
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """`tessera router [options]`, wired into tessera.cli."""
    router = subparsers.add_parser(
        "router", help="a prefix- and load-aware proxy in front of an InferenceCluster's leaders"
    )
    add_router_args(router)
    router.set_defaults(handler=run_router)
