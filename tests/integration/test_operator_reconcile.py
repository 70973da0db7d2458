"""The operator against the genuine kube-apiserver: objects, status, scale, restart, GC."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.ports import free_port
from tests.integration.operator_harness import (
    FakeKubelet,
    apply_example,
    condition,
    failed,
    ic,
    kjson,
    pod_names,
    pods,
    running,
    running_operator,
    set_pod_status,
    wait_for,
)
from tests.serving.server import REPO_ROOT

SMALL = {"tensor": 3, "pipeline": 2}  # 6 pods a group, as the example
FAST_RESTART = {"backoffBaseSeconds": 2, "backoffMaxSeconds": 8, "resetAfterSeconds": 600}


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_example_becomes_rank_pods_services_and_a_ready_status(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    with running_operator(cluster, ns):
        apply_example(cluster, ns, "smollm2.yaml")
        expected = {f"smollm2-g0-s{s}-t{t}" for s in range(2) for t in range(3)}
        wait_for(lambda: pod_names(cluster, ns) == expected, "6 rank pods")
        obj = ic(cluster, ns, "smollm2")
        by_name = {p["metadata"]["name"]: p for p in pods(cluster, ns)}
        worker = by_name["smollm2-g0-s1-t2"]
        labels = worker["metadata"]["labels"]
        assert labels["tessera.dev/role"] == "worker" and labels["tessera.dev/stage"] == "1"
        assert labels["tessera.dev/tp-rank"] == "2" and labels["tessera.dev/revision"]
        assert (
            worker["spec"]["hostname"] == "smollm2-g0-s1-t2"
            and worker["spec"]["subdomain"] == "smollm2-ranks"
        )
        env = env_of(worker)
        assert env["TESSERA_LEADER_ADDR"] == f"smollm2-g0-s0-t0.smollm2-ranks.{ns}.svc"
        assert (env["TESSERA_RANK"], env["TESSERA_WORLD_SIZE"], env["TESSERA_LAYER_PARTITION"]) == (
            "5",
            "6",
            "16,14",
        )
        assert env["TESSERA_SEQUENCE_PARALLEL"] == "true" and env["PYTHONHASHSEED"] == "0"
        [owner] = worker["metadata"]["ownerReferences"]
        assert owner["uid"] == obj["metadata"]["uid"] and owner["controller"] is True
        # Its writes carry its name (managedFields, audit logs), not its HTTP library's.
        creators = {m["manager"] for m in worker["metadata"]["managedFields"] if m["operation"] == "Update"}
        assert creators == {"tessera-operator"}
        leader = by_name["smollm2-g0-s0-t0"]
        assert leader["spec"]["containers"][0]["command"] == ["tessera", "serve"]
        assert leader["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"

        def services_by_name() -> dict[str, Any]:
            return {s["metadata"]["name"]: s for s in kjson(cluster, "get", "svc", "-n", ns)["items"]}

        wait_for(lambda: {"smollm2", "smollm2-ranks"} <= set(services_by_name()), "both Services")
        services = services_by_name()
        assert services["smollm2-ranks"]["spec"]["clusterIP"] == "None"
        assert services["smollm2-ranks"]["spec"]["publishNotReadyAddresses"] is True
        assert services["smollm2"]["spec"]["selector"] == {  # the leaders, until a router pod is Ready
            "tessera.dev/cluster": "smollm2",
            "tessera.dev/role": "leader",
            "app.kubernetes.io/managed-by": "tessera-operator",
        }

        # Running pods are not Ready: only the leader's readiness probe makes the group Ready.
        for name in by_name:
            set_pod_status(cluster, ns, name, running(ready=False))
        wait_for(lambda: ic(cluster, ns, "smollm2")["status"]["groups"][0]["phase"] == "Starting", "Starting")
        obj = ic(cluster, ns, "smollm2")
        assert obj["status"]["readyReplicas"] == 0 and condition(obj, "Ready")["status"] == "False"
        set_pod_status(cluster, ns, "smollm2-g0-s0-t0", running(ready=True))
        wait_for(lambda: condition(ic(cluster, ns, "smollm2"), "Ready").get("status") == "True", "Ready")
        status = ic(cluster, ns, "smollm2")["status"]
        assert status["readyReplicas"] == 1 and status["replicas"] == 1 and status["updatedReplicas"] == 1
        assert status["observedGeneration"] == obj["metadata"]["generation"]
        assert status["endpoint"] == f"http://smollm2.{ns}.svc:8000/v1"
        assert status["selector"] == "tessera.dev/cluster=smollm2,tessera.dev/role=leader"
        assert condition(ic(cluster, ns, "smollm2"), "Progressing")["reason"] == "Complete"
        # kstatus' conditions, as GitOps tools read them (and as Kubernetes 1.20 accepts them).
        settled = ic(cluster, ns, "smollm2")
        assert (
            condition(settled, "Reconciling")["status"] == "False"
            and condition(settled, "Stalled")["status"] == "False"
        )
        table = cluster.kubectl("get", "ic", "-n", ns).stdout.split("\n")
        assert table[0].split() == ["NAME", "REPLICAS", "READY", "TP", "PP", "MODEL", "AGE"]
        assert table[1].split()[:6] == ["smollm2", "1", "1", "3", "2", "smollm2-135m-instruct"]


def test_scale_adds_and_removes_whole_groups(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    with running_operator(cluster, ns), FakeKubelet(cluster, ns):
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL)
        wait_for(lambda: len(pod_names(cluster, ns)) == 6, "group 0")
        cluster.kubectl("scale", "ic", "smollm2", "-n", ns, "--replicas=3")
        wait_for(lambda: len(pod_names(cluster, ns)) == 18, "3 groups")
        wait_for(lambda: ic(cluster, ns, "smollm2")["status"].get("readyReplicas") == 3, "3 ready groups")
        scale_path = f"/apis/tessera.dev/v1alpha1/namespaces/{ns}/inferenceclusters/smollm2/scale"
        scale = json.loads(cluster.kubectl("get", "--raw", scale_path).stdout)
        assert scale["status"]["replicas"] == 3 and "tessera.dev/role=leader" in scale["status"]["selector"]
        cluster.kubectl("scale", "ic", "smollm2", "-n", ns, "--replicas=1")
        wait_for(lambda: {n.split("-")[1] for n in pod_names(cluster, ns)} == {"g0"}, "only group 0")
        wait_for(lambda: ic(cluster, ns, "smollm2")["status"]["replicas"] == 1, "status.replicas 1")
        # A pod per stage (template.ranksPerPod = tensor): the rollout leaves a group of 2 pods.
        patch = {"spec": {"template": {"ranksPerPod": 3}}}
        cluster.kubectl("patch", "ic", "smollm2", "-n", ns, "--type", "merge", "-p", json.dumps(patch))

        def stage_pods() -> bool:
            names = pod_names(cluster, ns)
            return len(names) == 2 and all(re.fullmatch(r"smollm2-g\d+-s[01]", n) for n in names)

        wait_for(stage_pods, "a group of one pod per stage")
        wait_for(lambda: ic(cluster, ns, "smollm2")["status"].get("updatedReplicas") == 1, "rolled out")
        leader = next(p for p in pods(cluster, ns) if p["metadata"]["name"].endswith("-s0"))
        assert env_of(leader)["TESSERA_LOCAL_RANKS"] == "3"
        assert ic(cluster, ns, "smollm2")["status"]["groups"][0]["pods"] == 2


def evict(cluster: Any, ns: str, name: str) -> int:
    """The eviction API, as `kubectl drain` calls it: 201 when allowed, 429 when a budget forbids."""
    body = {"apiVersion": "policy/v1beta1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}}
    try:
        cluster.api("POST", f"/api/v1/namespaces/{ns}/pods/{name}/eviction", body)
    except urllib.error.HTTPError as exc:
        return exc.code
    return 201


def test_a_node_drain_takes_down_one_group_at_a_time(crds: Any, k8s_namespace: str) -> None:
    """The disruption budget lets one rank pod be evicted; its group restarts as a whole, and no
    other pod may go until every pod is Ready again. Below two replicas there is no budget."""
    cluster, ns = crds, k8s_namespace
    with running_operator(cluster, ns), FakeKubelet(cluster, ns, workers_ready=True):
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL, replicas=2)
        budget = wait_for(lambda: kjson(cluster, "get", "pdb", "smollm2", "-n", ns), "the disruption budget")
        assert budget["spec"]["minAvailable"] == 11
        assert budget["metadata"]["ownerReferences"][0]["kind"] == "InferenceCluster"
        wait_for(
            lambda: (
                kjson(cluster, "get", "pdb", "smollm2", "-n", ns)["status"].get("disruptionsAllowed") == 1
            ),
            "one disruption allowed once all 12 pods are Ready",
        )
        assert evict(cluster, ns, "smollm2-g1-s1-t1") == 201
        # The evicted rank's group restarts; until it is back, nothing else may be evicted.
        assert evict(cluster, ns, "smollm2-g0-s0-t0") == 429
        wait_for(
            lambda: (
                kjson(cluster, "get", "pdb", "smollm2", "-n", ns)["status"].get("disruptionsAllowed") == 1
            ),
            "the budget open again once group 1 is back",
            timeout=60,
        )
        cluster.kubectl("scale", "ic", "smollm2", "-n", ns, "--replicas=1")
        wait_for(
            lambda: not cluster.kubectl("get", "pdb", "-n", ns, "-o", "name").stdout.strip(), "no budget"
        )


def test_failed_pod_restarts_its_whole_group_with_backoff(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    with running_operator(cluster, ns), FakeKubelet(cluster, ns):
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL, replicas=2, restartPolicy=FAST_RESTART)
        wait_for(
            lambda: ic(cluster, ns, "smollm2").get("status", {}).get("readyReplicas") == 2, "2 ready groups"
        )
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, ns)}

        set_pod_status(cluster, ns, "smollm2-g1-s1-t0", failed())
        backing_off = wait_for(
            lambda: [g for g in ic(cluster, ns, "smollm2")["status"]["groups"] if g["phase"] == "BackingOff"],
            "group 1 backing off",
        )
        assert backing_off[0]["index"] == 1 and backing_off[0]["restarts"] == 1
        assert backing_off[0]["backoffSeconds"] == 2 and "exit code 1" in backing_off[0]["lastFailure"]
        degraded = condition(ic(cluster, ns, "smollm2"), "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "GroupRestarting"

        def group1_recreated() -> bool:
            now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, ns)}
            g1 = [n for n in before if "-g1-" in n]
            return all(n in now and now[n] != before[n] for n in g1)

        wait_for(group1_recreated, "group 1 recreated (every pod, new uids)", timeout=30)
        after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, ns)}
        assert all(after[n] == before[n] for n in before if "-g0-" in n), "group 0 must not restart"
        events = kjson(cluster, "get", "events", "-n", ns, "--field-selector", "involvedObject.name=smollm2")[
            "items"
        ]
        reasons = {e["reason"] for e in events}
        assert {"GroupFailed", "GroupRestarted"} <= reasons

        # A second failure doubles the delay: backoff, never a storm.
        wait_for(lambda: ic(cluster, ns, "smollm2")["status"]["readyReplicas"] == 2, "ready again")
        set_pod_status(cluster, ns, "smollm2-g1-s0-t1", failed(137))
        second = wait_for(
            lambda: [g for g in ic(cluster, ns, "smollm2")["status"]["groups"] if g["phase"] == "BackingOff"],
            "second backoff",
        )
        assert second[0]["restarts"] == 2 and second[0]["backoffSeconds"] == 4


def test_deleted_pod_and_edited_service_are_put_back(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    with running_operator(cluster, ns), FakeKubelet(cluster, ns):
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL, restartPolicy=FAST_RESTART)
        wait_for(lambda: ic(cluster, ns, "smollm2").get("status", {}).get("readyReplicas") == 1, "ready")
        cluster.kubectl("delete", "svc", "smollm2-ranks", "-n", ns)
        cluster.kubectl(
            "patch",
            "svc",
            "smollm2",
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"spec":{"selector":{"tessera.dev/role":"worker"}}}',
        )
        wait_for(
            lambda: kjson(cluster, "get", "svc", "smollm2-ranks", "-n", ns), "headless Service recreated"
        )
        wait_for(
            lambda: (
                kjson(cluster, "get", "svc", "smollm2", "-n", ns)["spec"]["selector"].get("tessera.dev/role")
                == "leader"
            ),
            "client Service selector restored",
        )
        cluster.kubectl("delete", "pod", "smollm2-g0-s1-t1", "-n", ns, "--wait=false")
        wait_for(
            lambda: len(pod_names(cluster, ns)) == 6 and "smollm2-g0-s1-t1" in pod_names(cluster, ns),
            "pod back",
        )
        group = ic(cluster, ns, "smollm2")["status"]["groups"][0]
        assert "PodDeleted" in (
            group.get("lastFailure") or ""
        )  # a running group lost a rank: whole-group restart


def test_operator_restart_creates_no_duplicates_and_removes_strays(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    with FakeKubelet(cluster, ns):
        with running_operator(cluster, ns):
            apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL, replicas=2)
            wait_for(lambda: ic(cluster, ns, "smollm2").get("status", {}).get("readyReplicas") == 2, "ready")
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, ns)}
        rank = pods(cluster, ns)[0]
        # A pod the cluster controls under a name it would never give is a stray; a pod that only
        # carries its labels (a client let through a NetworkPolicy, a `kubectl debug` copy) is not its own.
        for name, owners in (
            ("smollm2-intruder", rank["metadata"]["ownerReferences"]),
            ("smollm2-client", []),
        ):
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "labels": rank["metadata"]["labels"], "ownerReferences": owners},
                "spec": {"containers": [{"name": "x", "image": "busybox"}]},
            }
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod))
        with running_operator(cluster, ns) as operator:
            wait_for(lambda: "smollm2-intruder" not in pod_names(cluster, ns), "stray removed")
            time.sleep(3 * operator.resync)  # several resyncs
            after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, ns)}
    assert after.pop("smollm2-client")
    assert after == before


def test_pods_an_orphaning_delete_left_are_adopted_not_replaced(crds: Any, k8s_namespace: str) -> None:
    """`kubectl delete ic --cascade=orphan`, then the same manifest again: the running ranks are
    taken over (an ownerReference to the new object), none is recreated."""
    cluster, ns = crds, k8s_namespace
    with FakeKubelet(cluster, ns), running_operator(cluster, ns):
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL, replicas=1)
        wait_for(lambda: ic(cluster, ns, "smollm2").get("status", {}).get("readyReplicas") == 1, "ready")
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, ns)}
        cluster.kubectl("delete", "ic", "smollm2", "-n", ns, "--cascade=orphan")
        wait_for(lambda: not any(p["metadata"].get("ownerReferences") for p in pods(cluster, ns)), "orphaned")
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL, replicas=1)
        uid = ic(cluster, ns, "smollm2")["metadata"]["uid"]

        def adopted() -> bool:
            owners = [
                [o["uid"] for o in p["metadata"].get("ownerReferences") or []] for p in pods(cluster, ns)
            ]
            return len(owners) == 6 and all(o == [uid] for o in owners)

        wait_for(adopted, "pods adopted")
        wait_for(
            lambda: ic(cluster, ns, "smollm2").get("status", {}).get("readyReplicas") == 1, "ready again"
        )
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, ns)} == before


def test_deleting_the_cluster_garbage_collects_everything(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    pool = {"inferencePool": True, "endpointPicker": {"name": "smollm2-epp"}}  # its CRD: `crds`
    with running_operator(cluster, ns):
        garbage_collects_everything(cluster, ns, pool)


def garbage_collects_everything(cluster: Any, ns: str, pool: dict[str, Any]) -> None:
    apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL, replicas=2, router=pool)
    wait_for(lambda: len(pod_names(cluster, ns)) == 12, "12 pods")
    router = (
        "deployment,serviceaccount,role,rolebinding,inferencepool",
        *("-n", ns, "-l", "tessera.dev/router=smollm2"),
    )
    # The router's objects and the InferencePool, made under the chart's RBAC (the Role's
    # rights are the operator's own).
    wait_for(lambda: len(kjson(cluster, "get", *router)["items"]) == 5, "the router's objects")
    made = kjson(cluster, "get", "inferencepool", "smollm2", "-n", ns)
    assert made["spec"]["selector"]["matchLabels"]["tessera.dev/role"] == "leader"
    assert made["spec"]["targetPorts"] == [{"number": 8000}]
    # Kept whole by the released v1 schema (a field it lacks would have been pruned), its defaults
    # filled in.
    assert made["spec"]["endpointPickerRef"] == {
        "name": "smollm2-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
        "kind": "Service",
    }
    # Owned as the rest.
    [owner] = made["metadata"]["ownerReferences"]
    assert owner["uid"] == ic(cluster, ns, "smollm2")["metadata"]["uid"] and owner["controller"] is True
    role = kjson(cluster, "get", "role", "smollm2-router", "-n", ns)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    cluster.kubectl("delete", "ic", "smollm2", "-n", ns)
    wait_for(lambda: not pod_names(cluster, ns), "pods collected", timeout=60)
    wait_for(
        lambda: not kjson(cluster, "get", "svc", "-n", ns, "-l", "tessera.dev/cluster")["items"],
        "services collected",
    )
    wait_for(
        lambda: not kjson(cluster, "get", *router)["items"], "the router's objects collected", timeout=60
    )


def test_cluster_wide_operator_serves_any_namespace(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    other = f"{ns}-x"
    cluster.kubectl("create", "namespace", other)
    wait_for(lambda: cluster.service_account_ready(other), "default ServiceAccount (pods need it)")
    try:
        with running_operator(cluster, ns, cluster_wide=True):
            apply_example(cluster, other, "smollm2.yaml", parallelism=SMALL)
            wait_for(lambda: len(pod_names(cluster, other)) == 6, "pods in another namespace")
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


@contextlib.contextmanager
def stub_leader() -> Iterator[int]:
    """A leader's /health and /metrics on 127.0.0.1 (what the router polls), on a free port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"tessera:num_requests_waiting 0\n" if self.path == "/metrics" else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()


def test_the_router_follows_the_leaders_under_its_own_role_and_drops_a_leaving_one(
    crds: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    cluster, ns = crds, k8s_namespace
    with running_operator(cluster, ns), stub_leader() as leader_port:
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL)
        wait_for(lambda: "smollm2-g0-s0-t0" in pod_names(cluster, ns), "the leader pod")
        deployment = wait_for(
            lambda: kjson(cluster, "get", "deployment", "-n", ns, "-l", "tessera.dev/router=smollm2")[
                "items"
            ],
            "the router's Deployment",
        )[0]
        set_pod_status(cluster, ns, "smollm2-g0-s0-t0", running(ready=True, pod_ip="127.0.0.1"))
        # The Deployment's own command, as the router's ServiceAccount (bound by the operator's Role).
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        port = free_port()
        local = ["--host", "127.0.0.1", "--port", str(port), "--upstream-port", str(leader_port)]
        env = dict(
            os.environ, KUBECONFIG=cluster.user_kubeconfig(f"system:serviceaccount:{ns}:smollm2-router")
        )
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO_ROOT)]))
        log = (tmp_path / "router.log").open("wb")
        argv = [sys.executable, "-m", "tessera.cli", *container["command"][1:], *container["args"], *local]
        router = subprocess.Popen(
            [*argv, "--poll-interval", "0.2"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:

            def ready_endpoints() -> int | None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                        return int(json.loads(answer.read())["ready_endpoints"])
                except OSError:
                    return None

            wait_for(lambda: ready_endpoints() == 1, "the router routes to the Ready leader", timeout=60)
            cluster.kubectl("label", "pod", "smollm2-g0-s0-t0", "tessera.dev/leaving=true", "-n", ns)
            wait_for(lambda: ready_endpoints() == 0, "the router drops the leader marked leaving")
            # Its pod Ready (the Deployment counts it): the client Service moves to the router.
            [router_pod] = kjson(cluster, "get", "pods", "-n", ns, "-l", "tessera.dev/router=smollm2")[
                "items"
            ]
            set_pod_status(
                cluster, ns, router_pod["metadata"]["name"], running(ready=True, pod_ip="127.0.0.2")
            )
            wait_for(
                lambda: (
                    kjson(cluster, "get", "svc", "smollm2", "-n", ns)["spec"]["selector"]
                    == {"tessera.dev/router": "smollm2", "app.kubernetes.io/managed-by": "tessera-operator"}
                ),
                "the client Service selects the router's pods",
            )
        except BaseException:
            print((tmp_path / "router.log").read_text())
            raise
        finally:
            router.terminate()
            router.wait(timeout=20)
            log.close()
