"""The operator installed the way the Helm chart configures it, with its Deployment played on the host.

`helm template` renders the chart (webhook on, cluster-wide); everything but the Deployment is
applied as is (ServiceAccount, RBAC, the empty ValidatingWebhookConfiguration the operator fills
in). The Deployment's container runs as a host process with the chart's own arguments, under the
chart's ServiceAccount identity; only what points into a pod network is rewritten: the webhook is
served on 127.0.0.1 (where the host's apiserver calls it) and the ports are free ones.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import yaml

from e2e.pki import WEBHOOK_CLIENT_NAME
from tessera.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "tessera"
OPERATOR_BIN = Path(sys.executable).parent / "tessera-operator"
RELEASE, NAMESPACE = "tessera", "tessera-system"
# The webhook takes reviews only with the API server's client certificate (docs/SECURITY.md).
CHART_VALUES = (
    "webhook.enabled=true",
    "watch.clusterWide=true",
    f"webhook.clientAuth.names={{{WEBHOOK_CLIENT_NAME}}}",
)


class Cluster(Protocol):
    """What the operator is installed into, as this module uses it. e2e.local_cluster.LocalCluster
    is one; it is not imported here because its `up --operator` imports this module."""

    @property
    def bin_dir(self) -> Path: ...

    @property
    def env(self) -> dict[str, str]: ...

    @property
    def webhook_client_ca(self) -> str: ...

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]: ...

    def user_kubeconfig(self, user: str) -> str: ...

    def api(self, method: str, path: str) -> Any: ...


def render_chart(
    cluster: Cluster, release: str = RELEASE, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    helm = str(cluster.bin_dir / "helm")
    values = [arg for value in CHART_VALUES for arg in ("--set", value)]
    # As `helm install` would see it: the API server's version picks the PodDisruptionBudget's API.
    kube_version = cluster.api("GET", "/version")["gitVersion"]
    rendered = subprocess.run(
        [helm, "template", release, str(CHART), "-n", namespace, "--kube-version", kube_version, *values],
        check=True,
        capture_output=True,
        text=True,
        env=cluster.env,
    ).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def host_args(
    chart_args: list[str], health_port: int, webhook_port: int, cert_dir: Path, client_ca: str | None = None
) -> list[str]:
    """The chart's arguments, with the pod-network ones (and the pod's CA file) pointed at this host."""
    replaced = {
        "--liveness": f"http://127.0.0.1:{health_port}/healthz",
        "--webhook-port": str(webhook_port),
        "--webhook-host": "127.0.0.1",
        "--webhook-cert-dir": str(cert_dir),
    }
    if client_ca is not None:
        replaced["--webhook-client-ca"] = client_ca
    args = []
    for arg in chart_args:
        name = arg.split("=", 1)[0]
        if name == "--webhook-service":
            continue  # the operator runs on this host, not behind the chart's Service: keep the URL
        args.append(f"{name}={replaced[name]}" if name in replaced else arg)
    return [*args, "--webhook-addr=127.0.0.1"]


@dataclass
class ChartOperator:
    process: subprocess.Popen[bytes]
    health_url: str
    log_path: Path

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.process.returncode}: see {self.log_path}")
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_chart_operator(
    cluster: Cluster, workdir: Path, detached: bool = False, timeout: float = 90.0
) -> ChartOperator:
    """Applies the chart's objects and starts the operator; returns once its health check passes
    and its webhook is registered (so the first `kubectl apply` is already validated)."""
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd", "--all")
    docs = render_chart(cluster)
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    others = [d for d in docs if d["kind"] != "Deployment"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(others))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = cluster.user_kubeconfig(f"system:serviceaccount:{NAMESPACE}:{account}")
    health_port = free_port()
    cert_dir = workdir / "webhook-certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    args = host_args(container["args"], health_port, free_port(), cert_dir, cluster.webhook_client_ca)
    log_path = workdir / "operator.log"
    log: IO[bytes]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [str(OPERATOR_BIN), "--kubeconfig", kubeconfig, *args],
            env={**cluster.env, "KUBECONFIG": kubeconfig, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=detached,
        )
    operator = ChartOperator(process, f"http://127.0.0.1:{health_port}/healthz", log_path)
    webhook_name = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")["metadata"]["name"]
    deadline = time.monotonic() + timeout
    while not (operator.healthy() and _webhook_registered(cluster, webhook_name)):
        if time.monotonic() > deadline:
            operator.stop()
            raise TimeoutError(f"the operator did not become healthy with its webhook: see {log_path}")
        time.sleep(0.5)
    return operator


def _webhook_registered(cluster: Cluster, name: str) -> bool:
    config = cluster.api(
        "GET", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}"
    )
    return bool(config.get("webhooks"))
