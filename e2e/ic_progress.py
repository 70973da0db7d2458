"""An InferenceCluster's progress as one line (group phases, pod phases), and waiting for Ready.

Everything is read through kubectl (`get_json(*args)` returns `kubectl get ARGS -o json` decoded),
so the demo, the end-to-end tests and the benchmark watch a cluster the way a user would.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

GetJson = Callable[..., Any]


def ready_condition(ic: dict[str, Any]) -> bool:
    conditions = ic.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def live_pods(get_json: GetJson, namespace: str, name: str) -> list[dict[str, Any]]:
    items = get_json("get", "pods", "-n", namespace, "-l", f"tessera.dev/cluster={name}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def container_pid(pod: dict[str, Any]) -> int:
    """The node agent's container id is the pid of the container's (exec'd) command."""
    return int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("tessera://"))


def progress(get_json: GetJson, namespace: str, name: str) -> tuple[bool, str]:
    """(Ready?, one line: the Ready condition, each group's phase, pods by phase)."""
    ic = get_json("get", "ic", name, "-n", namespace)
    groups = ic.get("status", {}).get("groups") or []
    group_text = " ".join(f"g{g['index']}={g.get('phase', '?')}" for g in groups) or "-"
    pods = live_pods(get_json, namespace, name)
    phases = Counter(p.get("status", {}).get("phase", "Pending") for p in pods)
    pod_text = ", ".join(f"{count} {phase}" for phase, count in sorted(phases.items())) or "none"
    ready = ready_condition(ic)
    return ready, f"{name}: {'Ready' if ready else 'not ready'}; groups {group_text}; pods {pod_text}"


def wait_until_ready(
    get_json: GetJson,
    namespace: str,
    name: str,
    timeout: float,
    report: Callable[[str], None] | None = None,
    interval: float = 1.0,
) -> float:
    """Seconds until the Ready condition is True; `report` gets each changed progress line."""
    started = time.monotonic()
    last = ""
    while True:
        ready, line = progress(get_json, namespace, name)
        if report is not None and line != last:
            report(f"[{time.monotonic() - started:6.1f}s] {line}")
            last = line
        if ready:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{namespace}/{name} not Ready after {timeout:.0f}s: {line}")
        time.sleep(interval)


def revisions(get_json: GetJson, namespace: str, name: str) -> set[str]:
    return {p["metadata"]["labels"]["tessera.dev/revision"] for p in live_pods(get_json, namespace, name)}


def wait_until_rolled_out(
    get_json: GetJson, namespace: str, name: str, old_revisions: set[str], replicas: int, timeout: float
) -> float:
    """Seconds until every group is Ready at a new revision and no pod of `old_revisions` is left."""
    started = time.monotonic()
    while True:
        status = get_json("get", "ic", name, "-n", namespace).get("status", {})
        done = status.get("updatedReplicas") == replicas and status.get("readyReplicas") == replicas
        if done and not revisions(get_json, namespace, name) & old_revisions:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{namespace}/{name} not rolled out after {timeout:.0f}s: {status}")
        time.sleep(1)


def wait_until_recreated(
    get_json: GetJson, namespace: str, name: str, old_uids: set[str], timeout: float
) -> float:
    """Seconds until the cluster is Ready again on pods none of which is in `old_uids`."""
    started = time.monotonic()
    while True:
        uids = {p["metadata"]["uid"] for p in live_pods(get_json, namespace, name)}
        ready, line = progress(get_json, namespace, name)
        if ready and uids and not uids & old_uids:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{namespace}/{name} not recreated and Ready after {timeout:.0f}s: {line}")
        time.sleep(1)
