"""`tessera drain`: a leader pod's preStop hook. Returns once the server has no open model request.

It first waits `--min-seconds` (the time for the router, or the Service's endpoints, to stop
sending here), then polls the server's `/in-flight` until it reads 0 twice `--interval` apart;
the server keeps serving all the while (preStop runs before SIGTERM). Bounded by `--timeout`:
exit 1 past it, so the pod's event says the drain was cut short. A server that does not answer
has nothing to drain (exit 0). `--linger` sleeps after (a worker outlives its leader's shutdown).
Standard library only: it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

from tessera.entrypoints.in_flight import IN_FLIGHT_PATH


def open_requests(base_url: str, timeout: float) -> int | None:
    """The server's open model requests, or None where it does not answer."""
    try:
        with urllib.request.urlopen(base_url + IN_FLIGHT_PATH, timeout=timeout) as response:
            return int(json.loads(response.read())["in_flight"])
    except (OSError, ValueError, KeyError):
        return None


def drain(base_url: str, min_seconds: float, timeout: float, interval: float, linger: float) -> int:
    started = time.monotonic()
    deadline = started + timeout
    time.sleep(max(0.0, min(min_seconds, timeout)))
    idle_reads, code = 0, 0
    while idle_reads < 2:
        count = open_requests(base_url, timeout=max(interval, 1.0))
        if count is None:
            break  # not serving: nothing left to finish
        idle_reads = idle_reads + 1 if count == 0 else 0
        if idle_reads < 2 and time.monotonic() >= deadline:
            print(f"tessera drain: {count} requests still open after {timeout:g} s", file=sys.stderr)
            code = 1
            break
        if idle_reads < 2:
            time.sleep(interval)
    time.sleep(max(0.0, linger))
    return code


def _run(args: argparse.Namespace) -> int:
    return drain(args.url.rstrip("/"), args.min_seconds, args.timeout, args.interval, args.linger)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """`tessera drain [options]`, wired into tessera.cli."""
    parser = subparsers.add_parser(
        "drain", help="wait until a server's open requests are answered (a pod's preStop hook)"
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: this pod's)")
    parser.add_argument("--min-seconds", type=float, default=5.0, help="wait at least this long (default: 5)")
    parser.add_argument("--timeout", type=float, default=20.0, help="at most this long (default: 20)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between polls (default: 0.5)")
    parser.add_argument("--linger", type=float, default=0.0, help="seconds to sleep after (default: 0)")
    parser.set_defaults(handler=_run)
