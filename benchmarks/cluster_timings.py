"""The product's lifecycle timings on the local Kubernetes (3 Nodes run by the node agent).

With the operator configured as the Helm chart does (webhook on), it measures:

  * apply -> Ready of the demo spec (examples/smollm2.yaml: pipeline 2 x tensor 3, 6 rank pods);
  * a killed worker rank's process -> the group recreated and Ready again;
  * a rollout (an engine setting changed) of 2 groups of pipeline 2 x tensor 1: its duration and
    the requests served (and failed) meanwhile by a client calling the Service non-stop.

Writes benchmarks/results/cluster_timings_<machine kind>.json and a PNG timeline of the three phases.

    sudo .venv/bin/python benchmarks/cluster_timings.py
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import environment_info, new_figure, save_figure, write_json  # noqa: E402
from e2e.chart_operator import start_chart_operator  # noqa: E402
from e2e.ic_progress import (  # noqa: E402
    container_pid,
    live_pods,
    revisions,
    wait_until_ready,
    wait_until_recreated,
    wait_until_rolled_out,
)
from e2e.local_cluster import LocalCluster, binaries_installed, install_binaries  # noqa: E402
from e2e.request_loop import RequestLoop, connection_per_request_client  # noqa: E402

NAME = "cluster_timings"
DEMO = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
SERVED = DEMO["spec"]["model"]["servedName"]
TIMEOUT = 900.0
NODES = ("tessera-node-0", "tessera-node-1", "tessera-node-2")


class Phases:
    """Named (start, end) spans on one clock, for the JSON and the timeline."""

    def __init__(self) -> None:
        self.origin = time.monotonic()
        self.spans: dict[str, tuple[float, float]] = {}

    def record(self, name: str, start: float, end: float) -> float:
        self.spans[name] = (start - self.origin, end - self.origin)
        print(f"{name}: {end - start:.1f}s", flush=True)
        return end - start


def run(cluster: LocalCluster, phases: Phases) -> dict[str, Any]:
    def get_json(*args: str) -> Any:
        return json.loads(cluster.kubectl(*args, "-o", "json").stdout)

    def apply(doc: dict[str, Any], namespace: str) -> None:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

    for namespace in ("bench-demo", "bench-rollout"):
        cluster.kubectl("create", "namespace", namespace)
    name = DEMO["metadata"]["name"]
    start = time.monotonic()
    apply(DEMO, "bench-demo")
    wait_until_ready(get_json, "bench-demo", name, TIMEOUT, report=print)
    apply_to_ready = phases.record("apply_to_ready", start, time.monotonic())

    before = live_pods(get_json, "bench-demo", name)
    victim = next(p for p in before if p["metadata"]["name"].endswith("-s1-t1"))
    start = time.monotonic()
    os.kill(container_pid(victim), signal.SIGKILL)
    wait_until_recreated(get_json, "bench-demo", name, {p["metadata"]["uid"] for p in before}, TIMEOUT)
    kill_to_ready = phases.record("killed_rank_to_ready", start, time.monotonic())
    cluster.kubectl("delete", "ic", name, "-n", "bench-demo", "--wait=true")

    roll: dict[str, Any] = yaml.safe_load(yaml.safe_dump(DEMO))
    roll["metadata"]["name"] = "roll"
    roll["spec"]["replicas"] = 2
    roll["spec"]["parallelism"] = {"tensor": 1, "pipeline": 2, "layerPartition": [16, 14]}
    apply(roll, "bench-rollout")
    wait_until_ready(get_json, "bench-rollout", "roll", TIMEOUT, report=print)
    url = cluster.expose("bench-rollout", "roll", 8000)
    client = connection_per_request_client(f"{url}/v1", max_retries=0, timeout=60)
    with RequestLoop(client, SERVED) as loop:
        time.sleep(5)
        old = revisions(get_json, "bench-rollout", "roll")
        start = time.monotonic()
        roll["spec"]["engine"]["maxNumSeqs"] = 16
        apply(roll, "bench-rollout")
        wait_until_rolled_out(get_json, "bench-rollout", "roll", old, 2, TIMEOUT)
        end = time.monotonic()
        time.sleep(5)
    rollout = phases.record("rollout", start, end)
    return {
        "apply_to_ready_seconds": round(apply_to_ready, 1),
        "killed_rank_to_ready_seconds": round(kill_to_ready, 1),
        "rollout": {
            "seconds": round(rollout, 1),
            "groups": 2,
            "layout": "pp=2 x tp=1 per group, maxSurge 1, maxUnavailable 0",
            "requests_served_during": loop.served_between(start, end),
            "requests_failed_total": len(loop.failures()),
            "failures": loop.failures()[:10],
        },
        "requests": [
            [round(o.started - phases.origin, 2), round(o.finished - phases.origin, 2), o.error is None]
            for o in loop.outcomes
        ],
    }


def plot(results: dict[str, Any], spans: dict[str, tuple[float, float]]) -> None:
    figure, axes = new_figure(width=9, height=3.6)
    ax = axes[0][0]
    labels = {
        "apply_to_ready": "apply -> Ready (pp2 x tp3)",
        "killed_rank_to_ready": "rank killed -> Ready",
        "rollout": "rollout (2 groups)",
    }
    for row, key in enumerate(labels):
        start, end = spans[key]
        ax.barh(row, end - start, left=start, color=f"C{row}")
        ax.text(end + 2, row, f"{end - start:.0f}s", va="center")
    ok = [r[1] for r in results["requests"] if r[2]]
    failed = [r[1] for r in results["requests"] if not r[2]]
    ax.plot(ok, [len(labels)] * len(ok), "|", color="green", label="request served")
    ax.plot(failed, [len(labels)] * len(failed), "x", color="red", label="request failed")
    ax.set_yticks(range(len(labels) + 1), [*labels.values(), "client requests"])
    ax.set_xlabel("seconds since the benchmark started")
    ax.set_title("Tessera on the local Kubernetes: lifecycle timings")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(NAME, figure)


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("the node agent needs root (network namespaces, mounts)")
    if not binaries_installed():
        install_binaries()
    phases = Phases()
    with LocalCluster(node_name=None, nodes=NODES) as cluster:
        operator = start_chart_operator(cluster, Path(tempfile.mkdtemp(prefix="tessera-bench-operator-")))
        try:
            results = run(cluster, phases)
        finally:
            operator.stop()
    results["spans"] = {k: [round(a, 1), round(b, 1)] for k, (a, b) in phases.spans.items()}
    results["environment"] = environment_info()
    print(f"wrote {write_json(NAME, results)}")
    plot(results, phases.spans)


if __name__ == "__main__":
    main()
