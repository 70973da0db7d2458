"""`tessera serve` flags, kept apart from the server so `tessera --help` stays light (the
subcommand itself: serve_command.py)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from tessera.engine.arg_utils import add_engine_args, parse_size
from tessera.entrypoints.limits import add_limit_args
from tessera.metrics import METRIC_PREFIXES


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
        type=_non_negative_int,
        default=None,
        help="answer 503 + Retry-After when a request's sequences (prompts x n) would join more than this "
        "many waiting for the engine; a request is always admitted when none wait (default: 4 x the "
        "sequences the KV cache holds at full context length, num_kv_blocks x block_size / max_model_len, "
        "or 4 x --max-num-seqs when that is more)",
    )
    parser.add_argument(
        "--metrics-prefix",
        choices=sorted(METRIC_PREFIXES),
        default="tessera",
        help="the name prefix of /metrics' series: tessera (tessera:num_requests_waiting, ...), vllm "
        "(vllm:num_requests_waiting, ...: what dashboards, KEDA triggers and llm-d's endpoint picker "
        "written for vLLM read), or both (each series under both names) (default: tessera)",
    )
    add_http_args(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_limit_args(parser)
    add_engine_args(parser, exclude=("model",))


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)  # --max-waiting-requests 0: nothing may wait behind a waiting one


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """What one connection may hold of the server: uvicorn's names where it has them."""
    group = parser.add_argument_group("HTTP connections")
    group.add_argument(
        "--limit-concurrency",
        type=_positive_int,
        default=4096,
        help="most open connections and running requests; beyond, a request is answered 503 at once "
        "(uvicorn's limit_concurrency; the server raises its open-file limit to fit) (default: 4096)",
    )
    group.add_argument(
        "--timeout-keep-alive",
        type=_positive_float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open (uvicorn's; as vLLM's) (default: 5)",
    )
    group.add_argument(
        "--timeout-header",
        type=_positive_float,
        default=10.0,
        help="seconds from a connection's (or request's) first byte to the end of its headers; "
        "a slower client is disconnected (default: 10)",
    )
    group.add_argument(
        "--timeout-body",
        type=_positive_float,
        default=30.0,
        help="seconds to receive a request body once its headers are in; a slower client gets 408 and "
        "is disconnected (default: 30)",
    )
    group.add_argument(
        "--max-header-size",
        type=parse_size,
        default=64 * 1024,
        help="largest request line plus headers, in bytes; a larger one is refused (431) and "
        "disconnected (default: 64KiB)",
    )
    group.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no /docs, /redoc or /openapi.json (as vLLM's flag). Without it they are served as in "
        "vLLM, but behind the API key when one is set",
    )
