"""The queue-depth autoscaler against the genuine kube-apiserver, under the chart's RBAC.

The leaders' /metrics is a real HTTP server on a loopback address that the fake kubelet gives
every pod as its IP, so the test sets the queue the operator reads; the real runtime under real
load is in tests/e2e/test_product_on_cluster.py.
"""

from __future__ import annotations

import errno
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tessera.topology import DEFAULT_API_PORT
from tests.integration.operator_harness import (
    FakeKubelet,
    apply_example,
    ic,
    kjson,
    pod_names,
    running_operator,
    wait_for,
)

pytestmark = pytest.mark.k8s


class QueueGauge:
    """What every leader's /metrics reports as requests waiting."""

    def __init__(self) -> None:
        self.waiting = 0.0
        self.scrapes = 0


@contextmanager
def metrics_endpoint(gauge: QueueGauge) -> Iterator[str]:
    """Serves /metrics on port 8000 (the leaders' http port) of a free 127.x address; yields it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            gauge.scrapes += 1
            body = f'tessera:num_requests_waiting{{model_name="smollm2"}} {gauge.waiting}\n'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    for _ in range(20):
        address = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(2, 254)}"
        try:
            server = ThreadingHTTPServer((address, DEFAULT_API_PORT), Handler)
            break
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    else:
        raise RuntimeError(f"no loopback address had port {DEFAULT_API_PORT} free")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        server.shutdown()
        server.server_close()


def events(cluster: Any, ns: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in kjson(cluster, "get", "events", "-n", ns)["items"] if e["reason"] == reason]


def test_queue_depth_scales_groups_up_at_once_and_down_after_the_window(
    crds: Any, k8s_namespace: str
) -> None:
    cluster, ns = crds, k8s_namespace
    gauge = QueueGauge()
    autoscaling = {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 3,
        "targetQueueDepth": 4,
        "scaleDownStabilizationSeconds": 4,
    }
    with (
        metrics_endpoint(gauge) as address,
        running_operator(cluster, ns, "--autoscale-interval", "1"),
        FakeKubelet(cluster, ns, pod_ip=address),
    ):
        apply_example(
            cluster, ns, "smollm2.yaml", parallelism={"tensor": 1, "pipeline": 2}, autoscaling=autoscaling
        )
        wait_for(lambda: ic(cluster, ns, "smollm2")["status"].get("readyReplicas") == 1, "group 0 Ready")
        wait_for(lambda: gauge.scrapes >= 2, "the operator sampling the leader")
        assert ic(cluster, ns, "smollm2")["spec"]["replicas"] == 1  # an empty queue at minReplicas

        gauge.waiting = 9  # 9 waiting at one group, 4 per group wanted: 3 groups
        wait_for(lambda: ic(cluster, ns, "smollm2")["spec"]["replicas"] == 3, "scale-up to 3", timeout=30)
        wait_for(lambda: len(pod_names(cluster, ns)) == 6, "3 groups of 2 pods")
        wait_for(lambda: ic(cluster, ns, "smollm2")["status"].get("readyReplicas") == 3, "3 ready groups")
        status = ic(cluster, ns, "smollm2")["status"]["autoscaling"]
        assert status["desiredReplicas"] == 3 and status["lastScaleTime"]
        [scaled_up] = events(cluster, ns, "ScaledUp")
        assert scaled_up["message"].startswith("replicas 1 -> 3: 9 requests waiting at 1 Ready group(s)")

        gauge.waiting = 0  # the window keeps 3 groups for 4 s, then the queue says 1
        wait_for(lambda: ic(cluster, ns, "smollm2")["spec"]["replicas"] == 1, "scale-down to 1", timeout=40)
        wait_for(lambda: {n.split("-")[1] for n in pod_names(cluster, ns)} == {"g0"}, "only group 0")
        assert events(cluster, ns, "ScaledDown")
        assert ic(cluster, ns, "smollm2")["status"]["autoscaling"]["queueDepth"] == 0
