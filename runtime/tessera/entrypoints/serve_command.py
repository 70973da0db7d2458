"""`tessera serve MODEL [options]` as a subcommand of tessera.cli: the flags now, the server
(FastAPI, uvicorn, the engine) only when it runs, so `tessera --help` stays light."""

from __future__ import annotations

import argparse

from tessera.entrypoints.serve_args import add_serve_args


def _run_server(args: argparse.Namespace) -> int:
    from tessera.entrypoints.api_server import run_server

    return run_server(args)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """`tessera serve MODEL [options]`, wired into tessera.cli."""
    serve = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_args(serve)
    serve.set_defaults(handler=_run_server)
