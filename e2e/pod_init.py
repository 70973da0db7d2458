"""Init containers and termination messages, as the kubelet runs them (for e2e.pod_runtime).

A pod's initContainers run one at a time, in order, each to completion, before any of its
containers starts. One that fails is restarted with backoff unless the pod's restartPolicy is
Never; then the pod fails (its phase Failed, `kubectl get` showing Init:Error). While they run,
the pod is Pending, its Initialized condition False, its containers waiting in PodInitializing.

A container that fails with terminationMessagePolicy FallbackToLogsOnError gets the tail of
its log as its termination message (2048 bytes or 80 lines at most, the kubelet's bounds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

MESSAGE_MAX_BYTES = 2048
MESSAGE_MAX_LINES = 80


class _Container(Protocol):
    spec: Mapping[str, Any]
    terminated: dict[str, Any] | None


def termination_message(spec: Mapping[str, Any], log: Path, offset: int, exit_code: int) -> str | None:
    """The message of a container that exited: its log's tail (from `offset`, this run's first
    byte) when it failed under FallbackToLogsOnError; None otherwise (no termination-log file
    is served by the node agent)."""
    if exit_code == 0 or spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return None
    try:
        with open(log, "rb") as handle:
            handle.seek(max(offset, handle.seek(0, 2) - MESSAGE_MAX_BYTES))
            tail = handle.read().decode(errors="replace")
    except OSError:
        return None
    lines = [line.rsplit("\r", 1)[-1] for line in tail.splitlines()]  # progress bars: the last frame
    return "\n".join(lines[-MESSAGE_MAX_LINES:]) or None


def initialized(init: Sequence[_Container]) -> bool:
    """Every init container completed (exit 0)."""
    return all(c.terminated is not None and c.terminated["exitCode"] == 0 for c in init)


def init_failed(init: Sequence[_Container]) -> bool:
    """One failed for good (restartPolicy Never): the pod fails."""
    return any(c.terminated is not None and c.terminated["exitCode"] != 0 for c in init)


def current(init: Sequence[_Container]) -> int | None:
    """Index of the init container that runs (or is next), None when all completed."""
    return next((i for i, c in enumerate(init) if c.terminated is None), None)
