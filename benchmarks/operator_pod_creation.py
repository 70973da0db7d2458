"""Operator control-plane speed: time from `kubectl apply` to every rank pod created.

Runs on the genuine local control plane (etcd + kube-apiserver + kube-controller-manager
from `e2e/`), with the operator as a subprocess (`tessera-operator`), and measures:

  * one InferenceCluster of 2 replicas x 2 stages x 2 TP ranks (8 pods);
  * 100 such clusters applied at once (800 pods); target: under 30 s.

Pod creations are timed from a watch on the API server (the moment each ADDED event
arrives), not by polling. Writes benchmarks/results/operator_pod_creation_<machine kind>.json + .png
(named like every benchmark here: common.result_path).

    .venv/bin/python benchmarks/operator_pod_creation.py [--clusters 100]
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import environment_info, new_figure, save_figure, write_json  # noqa: E402

from e2e.local_cluster import LocalCluster  # noqa: E402

NAME = "operator_pod_creation"
OPERATOR = Path(sys.executable).parent / "tessera-operator"
PODS_PER_CLUSTER = 8  # 2 replicas x 2 stages x 2 TP ranks


class PodWatch:
    """Counts pod ADDED events in a namespace; records when each arrived."""

    def __init__(self, cluster: LocalCluster, ns: str) -> None:
        self.cluster, self.ns = cluster, ns
        self.times: list[float] = []
        self.seen: set[str] = set()
        self._stop = False
        listing = cluster.api("GET", f"/api/v1/namespaces/{ns}/pods")
        self._rv = listing["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        url = f"{self.cluster.api_url}/api/v1/namespaces/{self.ns}/pods?watch=1&resourceVersion={self._rv}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.cluster.admin_token}"})
        context = ssl.create_default_context(cafile=self.cluster.ca_file)
        with urllib.request.urlopen(request, context=context, timeout=600) as stream:
            for line in stream:
                if self._stop:
                    return
                event = json.loads(line)
                name = event["object"]["metadata"]["name"]
                if event["type"] == "ADDED" and name not in self.seen:
                    self.seen.add(name)
                    self.times.append(time.monotonic())

    def wait(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.times)}/{count} pods created")
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop = True


def manifests(prefix: str, count: int) -> str:
    docs = [
        {
            "apiVersion": "tessera.dev/v1alpha1",
            "kind": "InferenceCluster",
            "metadata": {"name": f"{prefix}{i}"},
            "spec": {
                "model": {"source": "llama-3.1-8b-instruct"},  # 32 heads: 2 TP ranks take them
                "parallelism": {"tensor": 2, "pipeline": 2},
                "replicas": 2,
            },
        }
        for i in range(count)
    ]
    return yaml.safe_dump_all(docs)


def kubectl_apply(cluster: LocalCluster, ns: str, text: str) -> subprocess.Popen[str]:
    cmd = [str(cluster.bin_dir / "kubectl"), "--kubeconfig", cluster.kubeconfig, "apply", "-n", ns, "-f", "-"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=cluster.env)
    assert proc.stdin is not None
    proc.stdin.write(text)
    proc.stdin.close()
    return proc


def measure(cluster: LocalCluster, ns: str, count: int, kubectls: int, timeout: float) -> dict[str, Any]:
    """Apply `count` clusters with `kubectls` kubectl processes at once; time until every pod exists."""
    watch = PodWatch(cluster, ns)
    chunks = [manifests(f"ic{k}-", len(range(k, count, kubectls))) for k in range(kubectls)]
    start = time.monotonic()
    procs = [kubectl_apply(cluster, ns, text) for text in chunks]
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError("kubectl apply failed")
    applied = time.monotonic() - start
    expected = count * PODS_PER_CLUSTER
    watch.wait(expected, timeout)
    watch.stop()
    times = [t - start for t in watch.times[:expected]]
    seconds = times[-1]
    return {
        "clusters": count,
        "pods": expected,
        "kubectl_processes": kubectls,
        "seconds_to_all_pods_created": round(seconds, 3),
        "pods_per_second": round(expected / seconds, 1),
        "kubectl_apply_seconds": round(applied, 3),
        "operator_lag_after_last_apply_seconds": round(max(seconds - applied, 0.0), 3),
        "first_pod_seconds": round(times[0], 3),
        "creation_curve": [round(t, 3) for t in times],
    }


def plot(results: dict[str, Any]) -> Path:
    fig, axes = new_figure(width=7.0, height=4.2)
    ax = axes[0][0]
    for run in results["runs"]:
        curve = run["creation_curve"]
        ax.step(
            curve,
            range(1, len(curve) + 1),
            where="post",
            label=f"{run['clusters']} cluster(s), {run['kubectl_processes']} kubectl: {run['pods_per_second']} pods/s",
        )
    ax.axvline(30, color="red", linestyle="--", linewidth=1, label="target: 800 pods < 30 s")
    ax.set_xlabel("seconds since `kubectl apply`")
    ax.set_ylabel("rank pods created")
    ax.set_title("tessera-operator: pod creation on a genuine kube-apiserver (2 cores)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return save_figure(NAME, fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--kubectls", type=int, default=10, help="parallel kubectl processes in the last run")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=96)
    args = parser.parse_args()

    with LocalCluster() as cluster:
        cluster.kubectl("apply", "-f", str(REPO / "crds"))
        cluster.kubectl("wait", "--for", "condition=established", "crd/inferenceclusters.tessera.dev")
        namespaces = ["bench-one", "bench-many-serial", "bench-many-parallel"]
        for ns in namespaces:
            cluster.kubectl("create", "namespace", ns)
        log = open(os.devnull, "wb")  # noqa: SIM115 - lives as long as the subprocess
        operator = subprocess.Popen(
            [
                str(OPERATOR),
                *(f"--namespace={ns}" for ns in namespaces),
                "--kubeconfig",
                cluster.kubeconfig,
                "--liveness",
                "",
                "--workers",
                str(args.workers),
                "--concurrency",
                str(args.concurrency),
                "--resync-seconds",
                "60",
            ],
            env={**cluster.env, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=log,
        )
        try:
            time.sleep(3)  # the operator's watches start
            runs = [
                measure(cluster, namespaces[0], 1, 1, timeout=60),
                measure(cluster, namespaces[1], args.clusters, 1, timeout=300),
                measure(cluster, namespaces[2], args.clusters, args.kubectls, timeout=300),
            ]
        finally:
            operator.terminate()
            operator.wait(timeout=30)
            log.close()

    results: dict[str, Any] = {
        "benchmark": NAME,
        "kubernetes": "kube-apiserver v1.20.2 (Debian source build), etcd 3.4, loopback",
        "operator": {"workers": args.workers, "concurrency": args.concurrency},
        "target": "800 pods created in < 30 s",
        "note": "a single kubectl creates objects one by one (its own client is the limit); the parallel run "
        "splits the same manifests over several kubectl processes",
        "runs": runs,
        "environment": environment_info(),
    }
    print(f"wrote {write_json(NAME, results)} and {plot(results)}")
    for run in results["runs"]:
        print(
            f"{run['clusters']:>4} cluster(s), {run['pods']:>4} pods, {run['kubectl_processes']:>2} kubectl: "
            f"{run['seconds_to_all_pods_created']:.2f} s, {run['pods_per_second']} pods/s "
            f"(kubectl apply itself {run['kubectl_apply_seconds']:.2f} s, "
            f"operator lag after it {run['operator_lag_after_last_apply_seconds']:.2f} s)"
        )


if __name__ == "__main__":
    main()
