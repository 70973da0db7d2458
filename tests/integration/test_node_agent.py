"""The node agent plays the kubelet against the genuine API: kube-scheduler places, the agent runs.

Everything goes through kubectl against the complete local cluster (`local_cluster_full`): pods
get their own network identity and DNS, honest status, restart policies, graceful deletion, and a
Service is reachable from the host through the proxy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import podnet
from e2e.local_cluster import LocalCluster

pytestmark = pytest.mark.k8s

PYTHON = "python"  # resolved through the pod's PATH: the checkout's virtual environment first

# Serves "/" and "/stream"; the stream sends its first line, then holds its second until a request
# to "/release" arrives, so the test can tell streaming from buffering without measuring time.
WEB_SERVER = textwrap.dedent(
    """
    import http.server, socketserver, threading
    released = threading.Event()
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            if self.path == "/stream":
                self.wfile.write(b"first\\n")
                self.wfile.flush()
                released.wait(60)
                self.wfile.write(b"second\\n")
            elif self.path == "/release":
                released.set()
            else:
                self.wfile.write(b"hello from web-0\\n")
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer(("0.0.0.0", 8080), Handler).serve_forever()
    """
)


def eventually(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.2)
    return result


def apply(cluster: LocalCluster, namespace: str, *objects: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))


def get_pod(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout))


def pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    labels = spec.pop("labels", {})
    container = {"name": "main", "image": "tessera-runtime:local", "command": command}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [container], **spec},
    }


def service(name: str, port: int, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"app": "web"},
        "ports": [{"name": "http", "port": port, "targetPort": 8080}],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def phase_is(cluster: LocalCluster, namespace: str, name: str, *phases: str) -> dict[str, Any] | None:
    got = get_pod(cluster, namespace, name)
    return got if got.get("status", {}).get("phase") in phases else None


def pod_gone(cluster: LocalCluster, namespace: str, name: str) -> bool:
    return cluster.kubectl("get", "pod", name, "-n", namespace, check=False).returncode != 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent has not reaped it yet).
    return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()


def test_a_pod_gets_ready_and_is_reachable_by_its_dns_names_and_through_the_proxy(
    local_cluster_full: LocalCluster, full_namespace: str
) -> None:
    cluster, ns = local_cluster_full, full_namespace
    probe = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    web = pod(
        "web-0",
        [PYTHON, "-c", WEB_SERVER],
        labels={"app": "web"},
        hostname="web-0",
        subdomain="web",
        container={"ports": [{"name": "http", "containerPort": 8080}], "readinessProbe": probe},
    )
    apply(cluster, ns, service("web", 8080, headless=True), service("web-svc", 8080), web)
    cluster.kubectl("wait", "--for=condition=Ready", "pod/web-0", "-n", ns, "--timeout=60s")

    got = get_pod(cluster, ns, "web-0")
    status = got["status"]
    assert status["phase"] == "Running"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    assert status["containerStatuses"][0]["ready"] and "running" in status["containerStatuses"][0]["state"]
    assert got["spec"]["nodeName"].startswith("tessera-node-")  # placed by kube-scheduler
    wide = cluster.kubectl("get", "pod", "web-0", "-n", ns, "-o", "wide").stdout
    assert status["podIP"] in wide and status["podIP"] != status["hostIP"]

    # A second pod, same port numbers, reaches the first by every name a pod would use.
    client_code = textwrap.dedent(
        """
        import socket, time, urllib.request
        for url in ["http://web-0.web:8080/", "http://web:8080/", "http://web-svc:8080/",
                    "http://web-svc.{ns}.svc.cluster.local:8080/"]:
            body = b""
            for attempt in range(50):  # the DNS follows the Endpoints within a second or two
                try:
                    body = urllib.request.urlopen(url, timeout=10).read()
                    break
                except OSError:
                    time.sleep(0.2)
            assert body == b"hello from web-0\\n", url
        print("hostname", socket.gethostname(), "resolves", socket.gethostbyname(socket.gethostname()))
        """
    ).format(ns=ns)
    apply(cluster, ns, pod("client", [PYTHON, "-c", client_code], restartPolicy="Never"))
    done = eventually(
        lambda: phase_is(cluster, ns, "client", "Succeeded", "Failed"), "the client pod finishes"
    )
    log = cluster.container_log(ns, "client", "main")
    assert done["status"]["phase"] == "Succeeded", log
    assert f"hostname client resolves {done['status']['podIP']}" in log

    # The host reaches the Service through one local URL, and streamed bytes arrive as sent.
    url = cluster.expose(ns, "web-svc", 8080)
    assert urllib.request.urlopen(url + "/", timeout=10).read() == b"hello from web-0\n"
    with urllib.request.urlopen(url + "/stream", timeout=30) as stream:
        assert stream.readline() == b"first\n"  # before the server may send the rest
        urllib.request.urlopen(url + "/release", timeout=10).read()
        assert stream.readline() == b"second\n"


def test_exit_codes_and_restart_policies(local_cluster_full: LocalCluster, full_namespace: str) -> None:
    cluster, ns = local_cluster_full, full_namespace
    # OnFailure: the first run fails, the restarted one succeeds (the pod folder is its workdir).
    # The failing run leaves a child behind: it goes with its container, as a runtime ends it.
    flaky = "if [ -f ran-once ]; then exit 0; fi; touch ran-once; sleep 1000 & echo $! > child; exit 1"
    apply(
        cluster,
        ns,
        pod("fails", ["sh", "-c", "exit 3"], restartPolicy="Never"),
        pod("flaky", ["sh", "-c", flaky], restartPolicy="OnFailure"),
    )

    failed = eventually(lambda: phase_is(cluster, ns, "fails", "Failed", "Succeeded"), "pod 'fails' ends")
    assert failed["status"]["phase"] == "Failed"
    container = failed["status"]["containerStatuses"][0]
    assert container["state"]["terminated"]["exitCode"] == 3
    assert container["state"]["terminated"]["reason"] == "Error"
    assert container["restartCount"] == 0

    flaky_done = eventually(lambda: phase_is(cluster, ns, "flaky", "Failed", "Succeeded"), "pod 'flaky' ends")
    assert flaky_done["status"]["phase"] == "Succeeded"
    container = flaky_done["status"]["containerStatuses"][0]
    assert container["restartCount"] == 1
    assert container["lastState"]["terminated"]["exitCode"] == 1
    assert container["state"]["terminated"]["exitCode"] == 0
    (child_file,) = (cluster.workdir / "pods").glob(f"{ns}_flaky_*/child")
    child = Path(f"/proc/{child_file.read_text().strip()}/stat")
    assert not child.exists() or child.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")


# Records its pids in the pod folder (its working directory), then waits. `setsid` puts one
# grandchild outside the process group: only the network namespace still finds it.
TREE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    def on_term(*_):
        open("got-sigterm", "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1] == "ignore" else on_term)
    child = subprocess.Popen(["sleep", "1000"])
    escaped = subprocess.Popen(["setsid", "sleep", "1000"])
    with open("pids.tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid} {escaped.pid}")
    os.rename("pids.tmp", "pids")
    while True:
        time.sleep(1)
    """
)


def _pod_pids(cluster: LocalCluster, ns: str, name: str) -> list[int]:
    paths = list((cluster.workdir / "pods").glob(f"{ns}_{name}_*/pids"))
    return [int(p) for p in paths[0].read_text().split()] if paths else []


@pytest.mark.parametrize(("mode", "grace"), [("honour", 30), ("ignore", 3)])
def test_deleting_a_pod_stops_its_whole_process_tree(
    local_cluster_full: LocalCluster, full_namespace: str, mode: str, grace: int
) -> None:
    cluster, ns = local_cluster_full, full_namespace
    name = f"tree-{mode}"
    apply(cluster, ns, pod(name, [PYTHON, "-c", TREE, mode], terminationGracePeriodSeconds=grace))
    pids = eventually(lambda: _pod_pids(cluster, ns, name), "the pod records its pids")
    assert all(pid_alive(pid) for pid in pids)
    pod_dir = next((cluster.workdir / "pods").glob(f"{ns}_{name}_*"))

    cluster.kubectl("delete", "pod", name, "-n", ns, "--wait=false")
    if mode == "ignore":
        # SIGTERM is ignored: the pod keeps running, marked for deletion, until its grace runs out.
        marked = get_pod(cluster, ns, name)
        assert marked["metadata"]["deletionTimestamp"] and pid_alive(pids[0])
    # A pod honouring SIGTERM is gone long before its 30 s grace.
    eventually(lambda: pod_gone(cluster, ns, name), f"pod {name} is deleted", timeout=20)
    eventually(
        lambda: not any(pid_alive(pid) for pid in pids), "every process of the pod is dead", timeout=10
    )
    assert (pod_dir / "got-sigterm").exists() == (mode == "honour")


def _affine_pod(name: str, group: str, kind: str) -> dict[str, Any]:
    term = {
        "labelSelector": {"matchLabels": {"group": group}},
        "topologyKey": "kubernetes.io/hostname",
    }
    affinity = {kind: {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return pod(
        name, ["sleep", "1000"], labels={"group": group}, affinity=affinity, terminationGracePeriodSeconds=1
    )


def test_the_scheduler_places_pods_by_affinity_across_the_agent_nodes(
    local_cluster_full: LocalCluster, full_namespace: str
) -> None:
    cluster, ns = local_cluster_full, full_namespace
    together = [_affine_pod(f"stage0-rank{i}", "stage0", "podAffinity") for i in range(3)]
    spread = [_affine_pod(f"stage{i}-leader", "leaders", "podAntiAffinity") for i in range(3)]
    apply(cluster, ns, *together, *spread)

    def nodes_of(names: list[str]) -> list[str] | None:
        pods = [get_pod(cluster, ns, n) for n in names]
        if not all(p.get("status", {}).get("phase") == "Running" for p in pods):
            return None
        return [p["spec"]["nodeName"] for p in pods]

    together_nodes = eventually(
        lambda: nodes_of([p["metadata"]["name"] for p in together]), "affine pods run"
    )
    spread_nodes = eventually(
        lambda: nodes_of([p["metadata"]["name"] for p in spread]), "anti-affine pods run"
    )
    assert len(set(together_nodes)) == 1  # TP ranks of one stage share a node
    assert len(set(spread_nodes)) == 3  # one per node: kube-scheduler read the hostname labels


def test_containers_get_their_environment_arguments_and_working_directory(
    local_cluster_full: LocalCluster, full_namespace: str, tmp_path: Path
) -> None:
    cluster, ns = local_cluster_full, full_namespace
    env = [
        {"name": "GREETING", "value": "hello"},
        {"name": "MESSAGE", "value": "$(GREETING) world"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "MODEL", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "model"}}},
    ]
    container = {
        "args": ["echo $MESSAGE $POD_NAME $POD_IP $MODEL $EXTRA_size $(GREETING) $(pwd)"],
        "env": env,
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "EXTRA_"}],
        "workingDir": str(tmp_path),
    }
    apply(cluster, ns, pod("env", ["sh", "-c"], restartPolicy="Never", container=container))
    # The ConfigMap does not exist yet: the kubelet reports it and retries.
    waiting = eventually(
        lambda: get_pod(cluster, ns, "env")["status"].get("containerStatuses"),
        "the pod reports its container",
    )
    assert waiting[0]["state"]["waiting"]["reason"] == "CreateContainerConfigError"
    settings = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}}
    apply(cluster, ns, {**settings, "data": {"model": "smollm2", "size": "135m"}})

    done = eventually(lambda: phase_is(cluster, ns, "env", "Succeeded", "Failed"), "the pod finishes")
    pod_ip = done["status"]["podIP"]
    assert (
        cluster.container_log(ns, "env", "main")
        == f"hello world env {pod_ip} smollm2 135m hello {tmp_path}\n"
    )


@pytest.mark.parametrize("agent_end", ["graceful", "agent-killed"])
def test_stopping_the_cluster_leaves_nothing_behind(local_cluster_full: LocalCluster, agent_end: str) -> None:
    # A cluster of its own (the session's keeps running); `local_cluster_full` only ensures the
    # binaries and the machine's support, and keeps the two control planes from starting at once.
    cluster = LocalCluster(node_name=None, nodes=["leftover-node-0", "leftover-node-1"]).start()
    try:
        apply(
            cluster, "default", pod("tree", [PYTHON, "-c", TREE, "ignore"], terminationGracePeriodSeconds=60)
        )
        pids = eventually(lambda: _pod_pids(cluster, "default", "tree"), "the pod records its pids")
        cluster.expose("default", "nothing-here", 80)
        processes = cluster.process_ids()
        assert podnet.agent_leftovers(cluster.agent_id)  # the check below can see what it looks for
        if agent_end == "agent-killed":
            # The agent cannot clean up after SIGKILL: stopping the cluster must still remove it all.
            os.kill(processes["node-agent"], signal.SIGKILL)
    finally:
        cluster.stop()

    assert podnet.agent_leftovers(cluster.agent_id) == []  # namespaces, links, mounts, /etc/netns files
    assert not [pid for pid in [*pids, *processes.values()] if pid_alive(pid)]
    assert not cluster.workdir.exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    leftovers = [str(cluster.workdir), f"--agent-id {cluster.agent_id}", podnet.name_prefix(cluster.agent_id)]
    assert not [line for line in ps.splitlines() if any(mark in line for mark in leftovers)]


# A rank pod's container as the operator builds it (read-only root, the workers' preStop drain),
# running a probe instead of the runtime: what a write to / does, what the secret volume holds,
# and when SIGTERM arrives.
ROOT_AND_DRAIN_PROBE = textwrap.dedent(
    """
    import os, signal, sys, time
    def say(line):
        print(line, flush=True)
    try:
        open("/tessera-write-probe", "w").close()
        say("root-write: ok")
    except OSError as error:
        say(f"root-write: {os.strerror(error.errno)}")
    open("/tmp/scratch", "w").write("x")
    say("tmp-write: ok")
    path = sys.argv[1]
    say(f"secret: {open(path).read()} mode {oct(os.stat(path).st_mode & 0o777)}")
    signal.signal(signal.SIGTERM, lambda *_: (say(f"sigterm: {time.time()}"), sys.exit(0)))
    say("ready")
    while True:
        time.sleep(0.1)
    """
)


def test_a_rank_container_has_a_read_only_root_its_secret_volume_and_drains_before_sigterm(
    local_cluster_full: LocalCluster, full_namespace: str
) -> None:
    from tessera_operator import builders
    from tessera_operator.api import InferenceClusterSpec

    cluster, ns = local_cluster_full, full_namespace
    spec = InferenceClusterSpec.model_validate(
        {"model": {"source": "smollm2-135m-instruct"}, "parallelism": {"pipeline": 2}}
    )
    worker = builders.build_group(builders.ClusterRef("c", ns, "u"), spec, "r", 0)[1]
    built = worker["spec"]["containers"][0]
    secret_path = "/etc/probe-secret/secret"
    container = {
        "args": ["-c", ROOT_AND_DRAIN_PROBE, secret_path],
        "securityContext": built["securityContext"],
        "lifecycle": built["lifecycle"],
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "key", "mountPath": "/etc/probe-secret", "readOnly": True},
        ],
    }
    volumes = [
        {"name": "tmp", "emptyDir": {}},
        {
            "name": "key",
            "secret": {
                "secretName": "probe",
                "items": [{"key": "group-0", "path": "secret"}],
                "defaultMode": 0o400,
            },
        },
    ]
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "probe"},
        "stringData": {"group-0": "k3y", "group-1": "other"},
    }
    apply(
        cluster,
        ns,
        secret,
        pod("probe", [PYTHON], restartPolicy="Never", container=container, volumes=volumes),
    )
    try:
        eventually(lambda: "ready" in cluster.container_log(ns, "probe", "main"), "the probe starts")
    except AssertionError:
        status = get_pod(cluster, ns, "probe").get("status")
        raise AssertionError(f"{status}\n{cluster.container_log(ns, 'probe', 'main')}") from None
    log = cluster.container_log(ns, "probe", "main")
    assert "root-write: Read-only file system" in log
    assert not Path("/tessera-write-probe").exists()
    assert "tmp-write: ok" in log  # the emptyDir stays writable
    assert "secret: k3y mode 0o400" in log  # only the group's own key, at the volume's mode

    deleted_at = time.time()
    cluster.kubectl("delete", "pod", "probe", "-n", ns, "--wait=false")
    line = eventually(
        lambda: next(
            (
                ln
                for ln in cluster.container_log(ns, "probe", "main").splitlines()
                if ln.startswith("sigterm")
            ),
            None,
        ),
        "SIGTERM reaches the container after its preStop hook",
        timeout=builders.WORKER_DRAIN_SECONDS + 20,
    )
    # The hook held SIGTERM back for the drain (`tessera drain`: the least wait, no leader there to
    # wait for, then the linger), not a moment.
    assert float(line.split()[1]) - deleted_at >= builders.WORKER_DRAIN_SECONDS - 1
    eventually(lambda: pod_gone(cluster, ns, "probe"), "the pod is deleted", timeout=30)


# As the router's kube source does: the `kubernetes` client's in-cluster configuration (the
# token, CA and namespace files, KUBERNETES_SERVICE_HOST/PORT), then what its RBAC allows.
IN_CLUSTER_CLIENT = textwrap.dedent(
    """
    import base64, json, os, ssl, urllib.request
    from kubernetes import client, config
    FILES = "/var/run/secrets/kubernetes.io/serviceaccount"
    config.load_incluster_config()
    api = client.CoreV1Api()
    namespace = open(f"{FILES}/namespace").read()
    print("pods", sorted(p.metadata.name for p in api.list_namespaced_pod(namespace).items))
    try:
        api.list_namespaced_secret(namespace)
        print("secrets allowed")
    except client.ApiException as error:
        print("secrets", error.status)
    token = open(f"{FILES}/token").read()
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    print("bound to", claims["kubernetes.io"]["pod"]["name"], claims["kubernetes.io"]["serviceaccount"]["name"])
    try:
        open(f"{FILES}/token", "w")
    except OSError as error:
        print("token file", error.strerror)
    # The Service's name resolves too, and the API server's certificate holds it.
    tls = ssl.create_default_context(cafile=f"{FILES}/ca.crt")
    version = urllib.request.urlopen("https://kubernetes.default.svc/version", context=tls, timeout=10)
    print("version", json.load(version)["major"], "host", os.environ["KUBERNETES_SERVICE_HOST"])
    """
)
NO_TOKEN = (
    "import os; print('token files', os.path.exists('/var/run/secrets/kubernetes.io/serviceaccount/token'))"
)


def test_pods_reach_the_api_server_as_their_service_account(
    local_cluster_full: LocalCluster, full_namespace: str
) -> None:
    cluster, ns = local_cluster_full, full_namespace
    reader = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}}
    quiet = {**reader, "metadata": {"name": "quiet"}, "automountServiceAccountToken": False}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "pod-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
    }
    apply(cluster, ns, reader, quiet, role, binding)
    never = {"restartPolicy": "Never"}
    apply(
        cluster,
        ns,
        pod("client", [PYTHON, "-c", IN_CLUSTER_CLIENT], serviceAccountName="reader", **never),
        pod("opted-out", [PYTHON, "-c", NO_TOKEN], automountServiceAccountToken=False, **never),
        pod("quiet", [PYTHON, "-c", NO_TOKEN], serviceAccountName="quiet", **never),
    )
    for name in ("client", "opted-out", "quiet"):
        done = eventually(lambda n=name: phase_is(cluster, ns, n, "Succeeded", "Failed"), f"{name} ends")
        assert done["status"]["phase"] == "Succeeded", cluster.container_log(ns, name, "main")
    gateway = podnet.gateway_address(int(done["status"]["podIP"].split(".")[1]))
    assert cluster.container_log(ns, "client", "main").splitlines() == [
        "pods ['client', 'opted-out', 'quiet']",
        "secrets 403",  # authenticated as the ServiceAccount, which RBAC lets list pods only
        "bound to client reader",
        "token file Read-only file system",
        f"version 1 host {gateway}",
    ]
    for name in ("opted-out", "quiet"):  # the pod's own field, else its ServiceAccount's
        assert cluster.container_log(ns, name, "main") == "token files False\n"
