"""`tessera serve` flags, kept apart from the server so `tessera --help` stays light."""

from __future__ import annotations

import argparse
import os

from tessera.engine.arg_utils import add_engine_args
from tessera.entrypoints.limits import add_limit_args


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="alias (e.g. smollm2-135m-instruct), Hugging Face folder, or .gguf file"
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TESSERA_API_PORT", "8000")))
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use (default: the model argument)",
    )
    parser.add_argument("--api-key", default=None, help="require this bearer key (or set TESSERA_API_KEY)")
    parser.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="web origins whose browser pages may call the API (CORS), e.g. https://chat.example.com or * "
        "(default: none, as a browser then refuses cross-origin calls)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 + Retry-After when a request's sequences (prompts x n) would join more than this "
        "many waiting for the engine; a request is always admitted when none wait (default: no limit)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_limit_args(parser)
    add_engine_args(parser, exclude=("model",))


def _run_server(args: argparse.Namespace) -> int:
    from tessera.entrypoints.api_server import run_server

    return run_server(args)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """`tessera serve MODEL [options]`, wired into tessera.cli."""
    serve = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_args(serve)
    serve.set_defaults(handler=_run_server)
