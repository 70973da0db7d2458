"""The shared model cache (an InferenceCluster's spec.model.cache): filled once, read by every rank.

`tessera model-cache fill SOURCE` (an init container of each group's leader pod, the cache mounted
read-write) converts SOURCE into ``$TESSERA_MODEL_CACHE/models/`` as ``resolve_model`` would: a
temporary folder, the ``.complete`` marker written last, an atomic rename, under a file lock, so
two groups filling at once convert once and the second finds the marker (a no-op). `tessera
model-cache wait SOURCE` (an init container of every other rank pod, the cache read-only) waits
for that marker, bounded, then fails with a message saying which step to look at. Either one's
last line on failure is the reason (the pod's termination message, FallbackToLogsOnError).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from tessera.models.conversion import WAIT_ENV, is_complete, wait_for_fill

log = logging.getLogger(__name__)


def fill(source: str) -> Path | None:
    """Converts ``source`` into the shared cache unless it is there already; None when it needs
    no conversion (a Hugging Face folder, an alias the image bakes in)."""
    from tessera.models.registry import conversion_target, resolve_model

    target = conversion_target(source)
    if target is None:
        print(f"model-cache: {source} needs no conversion: nothing to fill", flush=True)
        return None
    if is_complete(target):
        print(f"model-cache: {target} is complete already: no conversion", flush=True)
        return target
    started = time.monotonic()
    resolved = resolve_model(source)  # under the conversion's lock: one group converts
    print(f"model-cache: {resolved} ready after {time.monotonic() - started:.1f} s", flush=True)
    return resolved


def wait(source: str, timeout: float | None = None) -> Path | None:
    from tessera.models.registry import conversion_target

    target = conversion_target(source)
    if target is None:
        print(f"model-cache: {source} needs no conversion: nothing to wait for", flush=True)
        return None
    started = time.monotonic()
    wait_for_fill(target, timeout)
    print(f"model-cache: {target} complete after {time.monotonic() - started:.1f} s", flush=True)
    return target


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not os.environ.get("TESSERA_MODEL_CACHE"):
        print("model-cache: TESSERA_MODEL_CACHE is not set: no shared cache to use", file=sys.stderr)
        return 2
    try:
        if args.action == "fill":
            fill(args.source)
        else:
            wait(args.source, args.timeout)
    except Exception as exc:  # the last line is the termination message: say why, in one line
        print(f"model-cache: {args.action} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """`tessera model-cache fill|wait SOURCE`, wired into tessera.cli."""
    parser = subparsers.add_parser(
        "model-cache", help="fill the shared model cache ($TESSERA_MODEL_CACHE), or wait for its fill"
    )
    parser.add_argument("action", choices=("fill", "wait"))
    parser.add_argument("source", help="alias, Hugging Face folder, or .gguf file (spec.model.source)")
    parser.add_argument(
        "--timeout", type=float, default=None, help=f"wait: at most this long (default: ${WAIT_ENV} or 1800)"
    )
    parser.set_defaults(handler=_run)
