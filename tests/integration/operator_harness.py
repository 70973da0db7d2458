"""Helpers for the operator's integration tests on the genuine API server (no mocks here).

The operator runs as a subprocess (`tessera-operator`) under the identity of the Helm chart's
ServiceAccount, bound by the chart's own Role, so every test also proves the RBAC is enough.
There is no kubelet: `FakeKubelet` plays one by writing `pods/status` (Running, leader Ready).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tessera.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tessera"
OPERATOR_BIN = Path(sys.executable).parent / "tessera-operator"
T = TypeVar("T")


def wait_for(check: Callable[[], T], what: str, timeout: float = 30.0, interval: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # the state is still settling
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}; last: {last!r}")


def kjson(cluster: Any, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def pods(cluster: Any, ns: str) -> list[dict[str, Any]]:
    items = kjson(cluster, "get", "pods", "-n", ns, "-l", "tessera.dev/cluster")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def pod_names(cluster: Any, ns: str) -> set[str]:
    return {p["metadata"]["name"] for p in pods(cluster, ns)}


def ic(cluster: Any, ns: str, name: str) -> dict[str, Any]:
    return dict(kjson(cluster, "get", "ic", name, "-n", ns))


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return dict(c)
    return {}


def set_pod_status(cluster: Any, ns: str, name: str, status: dict[str, Any]) -> None:
    cluster.api(
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/{name}/status",
        {"status": status},
        content_type="application/merge-patch+json",
    )


def running(ready: bool, pod_ip: str | None = None) -> dict[str, Any]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        **({"podIP": pod_ip, "podIPs": [{"ip": pod_ip}]} if pod_ip else {}),
        "phase": "Running",
        "startTime": now,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now}],
        "containerStatuses": [
            {
                "name": "rank",
                "ready": ready,
                "restartCount": 0,
                "image": "tessera",
                "imageID": "",
                "state": {"running": {"startedAt": now}},
            }
        ],
    }


def failed(exit_code: int = 1) -> dict[str, Any]:
    return {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "rank",
                "ready": False,
                "restartCount": 0,
                "image": "tessera",
                "imageID": "",
                "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}},
            }
        ],
    }


class FakeKubelet:
    """Marks every new pod Running (leaders Ready unless `leaders_ready` is False), like a kubelet
    would; with `pod_ip`, every pod gets that address."""

    def __init__(
        self,
        cluster: Any,
        ns: str,
        leaders_ready: bool = True,
        pod_ip: str | None = None,
        workers_ready: bool = False,
    ) -> None:
        self.cluster, self.ns, self.leaders_ready, self.pod_ip = cluster, ns, leaders_ready, pod_ip
        self.workers_ready = workers_ready  # as a kubelet has them: no readiness probe, Ready once running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.started: set[str] = set()  # uids

    def __enter__(self) -> FakeKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for pod in pods(self.cluster, self.ns):
                    uid = pod["metadata"]["uid"]
                    if uid in self.started or pod.get("status", {}).get("phase") not in (None, "Pending"):
                        continue
                    leader = pod["metadata"]["labels"].get("tessera.dev/role") == "leader"
                    set_pod_status(
                        self.cluster,
                        self.ns,
                        pod["metadata"]["name"],
                        running(self.leaders_ready if leader else self.workers_ready, self.pod_ip),
                    )
                    self.started.add(uid)
            except Exception:  # a pod vanished between list and patch: next round
                pass
            self._stop.wait(0.3)


def install_rbac(
    cluster: Any, ns: str, release: str, extra: tuple[str, ...] = (), templates: tuple[str, ...] = ()
) -> str:
    """Render the chart's ServiceAccount + RBAC (+ `templates`) for `ns`, apply, return that identity's kubeconfig."""
    helm = str(Path(cluster.bin_dir) / "helm")
    shown = [
        arg
        for t in ("serviceaccount.yaml", "rbac.yaml", *templates)
        for arg in ("--show-only", f"templates/{t}")
    ]
    # The chart refuses a namespace list beside clusterWide (the list would look like a limit).
    scope = () if "watch.clusterWide=true" in extra else ("--set", f"watch.namespaces={{{ns}}}")
    rendered = subprocess.run(
        [helm, "template", release, str(CHART), "-n", ns, *scope, *shown, *extra],
        check=True,
        capture_output=True,
        text=True,
        env=cluster.env,
    ).stdout
    cluster.kubectl("apply", "-f", "-", input=rendered)
    return str(cluster.user_kubeconfig(f"system:serviceaccount:{ns}:{release}-operator"))


class OperatorProcess:
    """`tessera-operator --namespace NS` as a subprocess, with its log kept for failures."""

    def __init__(
        self, cluster: Any, ns: str | None, kubeconfig: str, *args: str, resync: float = 2.0
    ) -> None:
        self.cluster, self.ns, self.kubeconfig, self.args = cluster, ns, kubeconfig, args
        self.health_port = free_port()
        self.resync = resync
        self.log_path = Path(tempfile.mkstemp(prefix="tessera-operator-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = {**self.cluster.env, "KUBECONFIG": self.kubeconfig, "PYTHONUNBUFFERED": "1"}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                str(OPERATOR_BIN),
                *(["--namespace", self.ns] if self.ns else ["--all-namespaces"]),
                "--kubeconfig",
                self.kubeconfig,
                "--liveness",
                f"http://127.0.0.1:{self.health_port}/healthz",
                "--resync-seconds",
                str(self.resync),
                *self.args,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self.healthy, "the operator's health endpoint", timeout=60)
        return self

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


@contextmanager
def running_operator(
    cluster: Any,
    ns: str,
    *args: str,
    release: str | None = None,
    rbac_extra: tuple[str, ...] = (),
    cluster_wide: bool = False,
    templates: tuple[str, ...] = (),
) -> Iterator[OperatorProcess]:
    """The operator under the chart's RBAC, installed in `ns` (watching only `ns` unless cluster-wide)."""
    if cluster_wide:
        rbac_extra = (*rbac_extra, "--set", "watch.clusterWide=true")
    kubeconfig = install_rbac(cluster, ns, release or ns, rbac_extra, templates)
    operator = OperatorProcess(cluster, None if cluster_wide else ns, kubeconfig, *args).start()
    try:
        yield operator
    except BaseException:
        print("---- operator log ----\n" + operator.log())
        raise
    finally:
        operator.stop()
        if os.environ.get("TESSERA_KEEP_OPERATOR_LOGS") is None:
            operator.log_path.unlink(missing_ok=True)


def apply_example(cluster: Any, ns: str, example: str, **spec_patch: Any) -> dict[str, Any]:
    import yaml

    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    for key, value in spec_patch.items():
        doc["spec"][key] = value
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    return dict(doc)
