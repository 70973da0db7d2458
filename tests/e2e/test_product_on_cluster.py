"""The product end to end on the local Kubernetes: kubectl, the chart-configured operator, the rank
pods run by the node agent, the client Service, the `openai` client.

One module shares one full local cluster and one operator; the tests run in file order on the
demo InferenceCluster (examples/smollm2.yaml: pipeline 2 x tensor 3, sequence parallel), then on
a small one for the rollout (2 replicas of pipeline 2), so no two large groups run at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from e2e import podnet
from e2e.chart_operator import ChartOperator, start_chart_operator
from e2e.ic_progress import (
    container_pid,
    live_pods,
    revisions,
    wait_until_ready,
    wait_until_recreated,
    wait_until_rolled_out,
)
from e2e.local_cluster import LocalCluster
from e2e.request_loop import RequestLoop, connection_per_request_client
from tessera_operator.naming import router_selector

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEMO = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
# The tests of the leaders' own behaviour (failures, rollouts, scaling) take the client Service
# straight to them (spec.router off); test_the_router_... runs the router in front of them.
DEMO["spec"]["router"] = {"enabled": False}
NAME = DEMO["metadata"]["name"]
SERVED = DEMO["spec"]["model"]["servedName"]
READY_TIMEOUT = 420.0
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colors are"]
MAX_TOKENS = 16


class Ctx:
    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.cluster, self.ns = cluster, namespace

    def get_json(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl(*args, "-o", "json").stdout)

    def apply(self, doc: dict[str, Any]) -> None:
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=yaml.safe_dump(doc))

    def wait_ready(self, name: str) -> float:
        return wait_until_ready(self.get_json, self.ns, name, READY_TIMEOUT, report=print, interval=1)

    def client(self, name: str, **options: Any) -> openai.OpenAI:
        url = self.cluster.expose(self.ns, name, 8000)
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", **options)


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest, local_cluster_full: LocalCluster) -> Iterator[None]:
    """A failed test prints its pods' container logs and the node agent's and proxies' last lines."""
    started = time.time()
    yield
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(local_cluster_full.pod_logs_since(started))
        for name in local_cluster_full.log_names():
            if name.startswith(("node-agent", "proxy-")):
                print(f"--- {name}\n{local_cluster_full.logs(name)}")


@pytest.fixture(scope="module")
def operator(
    local_cluster_full: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChartOperator]:
    running = start_chart_operator(local_cluster_full, tmp_path_factory.mktemp("operator"))
    try:
        yield running
    finally:
        running.stop()
        if os.environ.get("TESSERA_KEEP_OPERATOR_LOGS") is None:
            print(running.log_path.read_text(errors="replace")[-4000:])


@pytest.fixture(scope="module")
def demo(local_cluster_full: LocalCluster, operator: ChartOperator) -> Iterator[Ctx]:
    """examples/smollm2.yaml applied as is, Ready."""
    namespace = "e2e-demo"
    local_cluster_full.kubectl("create", "namespace", namespace, check=False)
    ctx = Ctx(local_cluster_full, namespace)
    ctx.apply(DEMO)
    ctx.wait_ready(NAME)
    yield ctx
    local_cluster_full.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def greedy(client: openai.OpenAI) -> list[str]:
    return [
        client.completions.create(model=SERVED, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def one_process_answers() -> list[str]:
    """The prompts' greedy texts from one process (TP=1, PP=1): what every layout must answer."""
    from tessera import LLM, SamplingParams

    with LLM(
        DEMO["spec"]["model"]["source"],
        dtype="float32",
        max_model_len=512,
        num_threads=1,
        kv_cache_memory=256 << 20,
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        return [r.outputs[0].text for r in llm.generate(PROMPTS, params)]


def test_demo_spec_is_ready_after_rendezvous_and_answers_like_one_process(
    demo: Ctx, one_process_answers: list[str]
) -> None:
    pods = live_pods(demo.get_json, demo.ns, NAME)
    assert len(pods) == 6 and all(p["status"]["phase"] == "Running" for p in pods)
    leader = next(p for p in pods if p["metadata"]["labels"]["tessera.dev/role"] == "leader")
    log = demo.cluster.container_log(demo.ns, leader["metadata"]["name"], "rank")
    assert "6 ranks ready" in log, log[-3000:]  # the engine core saw every rank join

    assert greedy(demo.client(NAME)) == one_process_answers


def test_each_stage_tp_ranks_share_one_node(demo: Ctx) -> None:
    nodes_by_stage: dict[str, set[str]] = {}
    for pod in live_pods(demo.get_json, demo.ns, NAME):
        stage = pod["metadata"]["labels"]["tessera.dev/stage"]
        nodes_by_stage.setdefault(stage, set()).add(pod["spec"]["nodeName"])
    assert sorted(nodes_by_stage) == ["0", "1"]
    assert all(len(nodes) == 1 for nodes in nodes_by_stage.values()), nodes_by_stage


def test_killed_worker_rank_fails_in_flight_requests_then_group_is_recreated(
    demo: Ctx, one_process_answers: list[str]
) -> None:
    client = demo.client(NAME, max_retries=0, timeout=60)
    before = live_pods(demo.get_json, demo.ns, NAME)
    victim = next(p for p in before if p["metadata"]["name"].endswith("-s1-t1"))
    outcomes: list[str] = []
    streaming = [threading.Event() for _ in range(2)]

    def long_request(streaming: threading.Event) -> None:
        try:
            stream = client.completions.create(
                model=SERVED,
                prompt="Tell me a long story.",
                max_tokens=1500,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},  # still generating when the rank dies
            )
            for _ in stream:
                streaming.set()
            outcomes.append("completed")
        except openai.APIError as error:
            outcomes.append(f"error: {type(error).__name__}")

    requests = [threading.Thread(target=long_request, args=(event,)) for event in streaming]
    for thread in requests:
        thread.start()
    assert all(event.wait(90) for event in streaming), "the requests did not start streaming"
    os.kill(container_pid(victim), signal.SIGKILL)
    for thread in requests:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in requests), "an in-flight request hangs after a rank died"
    assert outcomes and all(o.startswith("error") for o in outcomes), outcomes

    wait_until_recreated(demo.get_json, demo.ns, NAME, {p["metadata"]["uid"] for p in before}, READY_TIMEOUT)
    assert len(live_pods(demo.get_json, demo.ns, NAME)) == 6
    try:
        assert greedy(demo.client(NAME, max_retries=0)) == one_process_answers  # the recreated group
    except openai.APIError:
        for pod in live_pods(demo.get_json, demo.ns, NAME):
            log = demo.cluster.container_log(demo.ns, pod["metadata"]["name"], "rank")
            print(f"---- {pod['metadata']['name']} ----\n{log[-2500:]}")
        raise


def test_delete_removes_every_pod_and_process(demo: Ctx) -> None:
    pods = live_pods(demo.get_json, demo.ns, NAME)
    pids = [container_pid(p) for p in pods]
    demo.cluster.kubectl("delete", "ic", NAME, "-n", demo.ns, "--wait=true", "--timeout=120s")
    deadline = time.monotonic() + 90
    while demo.get_json("get", "pods", "-n", demo.ns)["items"] or any(
        Path(f"/proc/{p}").exists() for p in pids
    ):
        assert time.monotonic() < deadline, "pods or their processes outlived `kubectl delete ic`"
        time.sleep(1)
    prefix = podnet.name_prefix(demo.cluster.agent_id)
    leftover = [ns for ns in podnet.ip("netns", "list").split() if ns.startswith(prefix) and demo.ns in ns]
    assert leftover == []


def rollout_spec() -> dict[str, Any]:
    """The demo's model as 2 replica groups of 2 pipeline stages (4 pods)."""
    doc: dict[str, Any] = yaml.safe_load(yaml.safe_dump(DEMO))
    doc["metadata"]["name"] = "roll"
    doc["spec"]["replicas"] = 2
    doc["spec"]["parallelism"] = {"tensor": 1, "pipeline": 2, "layerPartition": [16, 14]}
    return doc


def test_rollout_of_two_groups_keeps_answering_every_request(
    local_cluster_full: LocalCluster, operator: ChartOperator
) -> None:
    namespace = "e2e-rollout"
    local_cluster_full.kubectl("create", "namespace", namespace, check=False)
    ctx = Ctx(local_cluster_full, namespace)
    doc = rollout_spec()
    ctx.apply(doc)
    ctx.wait_ready("roll")
    try:
        url = local_cluster_full.expose(namespace, "roll", 8000)
        # A request takes well under a second; 60 s leaves room for 2 shared cores loading a
        # group, and still fails a request that hangs (as ones did while pods lost the host's MAC).
        client = connection_per_request_client(f"{url}/v1", max_retries=0, timeout=60)
        with RequestLoop(client, SERVED) as loop:
            time.sleep(2)
            old = revisions(ctx.get_json, namespace, "roll")
            started = time.monotonic()
            doc["spec"]["engine"]["maxNumSeqs"] = 16
            ctx.apply(doc)
            wait_until_rolled_out(ctx.get_json, namespace, "roll", old, 2, READY_TIMEOUT)
            finished = time.monotonic()
    finally:
        local_cluster_full.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    assert loop.failures() == []
    assert loop.served_between(started, finished) > 0


def test_queue_depth_adds_a_group_under_load_and_removes_it_after(
    local_cluster_full: LocalCluster, operator: ChartOperator
) -> None:
    """The operator's autoscaler on the real runtime: one sequence at a time per group, six clients
    keep five requests waiting, so a second group is added; idle again, it is removed."""
    namespace = "e2e-autoscale"
    local_cluster_full.kubectl("create", "namespace", namespace, check=False)
    ctx = Ctx(local_cluster_full, namespace)
    doc: dict[str, Any] = yaml.safe_load(yaml.safe_dump(DEMO))
    doc["metadata"]["name"] = "burst"
    doc["spec"]["parallelism"] = {"tensor": 1, "pipeline": 1}
    doc["spec"]["engine"]["maxNumSeqs"] = 1
    doc["spec"]["autoscaling"] = {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 2,
        "targetQueueDepth": 2,
        "scaleDownStabilizationSeconds": 5,
    }
    ctx.apply(doc)
    ctx.wait_ready("burst")

    def cluster() -> dict[str, Any]:
        return dict(ctx.get_json("get", "ic", "burst", "-n", namespace))

    try:
        url = local_cluster_full.expose(namespace, "burst", 8000)
        with contextlib.ExitStack() as clients:
            loops = [
                clients.enter_context(
                    RequestLoop(
                        connection_per_request_client(f"{url}/v1", max_retries=0, timeout=120), SERVED
                    )
                )
                for _ in range(6)
            ]
            deadline = time.monotonic() + READY_TIMEOUT
            while cluster()["status"].get("readyReplicas") != 2:
                assert time.monotonic() < deadline, f"no second Ready group under load: {cluster()['status']}"
                time.sleep(1)
            # Read under load: once the clients stop, a slow machine can already be scaling down.
            status = cluster()["status"]["autoscaling"]
        assert status["desiredReplicas"] == 2 and status["lastScaleTime"], status
        assert [f for loop in loops for f in loop.failures()] == []

        deadline = time.monotonic() + 120
        while cluster()["spec"]["replicas"] != 1 or len(live_pods(ctx.get_json, namespace, "burst")) != 1:
            assert time.monotonic() < deadline, f"not scaled back to one group: {cluster()['status']}"
            time.sleep(1)
        # The status holds the last sample until the next one, taken within an autoscale interval.
        deadline = time.monotonic() + 60
        while cluster()["status"]["autoscaling"]["queueDepth"] != 0:
            assert time.monotonic() < deadline, f"queue never drained: {cluster()['status']}"
            time.sleep(1)
    finally:
        local_cluster_full.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_pods_the_scheduler_cannot_place_stall_the_cluster_naming_why(
    local_cluster_full: LocalCluster, operator: ChartOperator
) -> None:
    """The genuine scheduler finds no node with 500 CPUs: the status says so at once
    (Degraded PodsNotStarting, with the scheduler's message), and past the progress deadline
    kstatus' Stalled turns True, so Flux or kpt stop waiting."""
    namespace = "e2e-unschedulable"
    local_cluster_full.kubectl("create", "namespace", namespace, check=False)
    ctx = Ctx(local_cluster_full, namespace)
    doc = yaml.safe_load(yaml.safe_dump(DEMO))
    doc["metadata"]["name"] = "huge"
    doc["spec"]["parallelism"] = {"tensor": 1, "pipeline": 1}
    doc["spec"]["template"]["resources"] = {"requests": {"cpu": "500"}}
    doc["spec"]["rollout"] = {"progressDeadlineSeconds": 5}
    ctx.apply(doc)

    def conditions() -> dict[str, dict[str, Any]]:
        status = ctx.get_json("get", "ic", "huge", "-n", namespace).get("status") or {}
        return {c["type"]: c for c in status.get("conditions") or []}

    try:
        deadline = time.monotonic() + 90
        while conditions().get("Stalled", {}).get("status") != "True":
            assert time.monotonic() < deadline, f"never Stalled: {conditions()}"
            time.sleep(1)
        degraded = conditions()["Degraded"]
        assert degraded["reason"] == "ProgressDeadlineExceeded", degraded
        assert "Unschedulable" in degraded["message"] and "Insufficient cpu" in degraded["message"], degraded
        events = ctx.get_json("get", "events", "-n", namespace, "--field-selector", "reason=PodsNotStarting")
        assert events["items"], "no PodsNotStarting event"
    finally:
        local_cluster_full.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _ready_replicas(ctx: Ctx, deployment: str) -> int:
    got = ctx.cluster.kubectl("get", "deploy", deployment, "-n", ctx.ns, "-o", "json", check=False)
    return (
        int((json.loads(got.stdout).get("status") or {}).get("readyReplicas", 0))
        if got.returncode == 0
        else 0
    )


def _router_series(metrics: str, name: str) -> dict[str, float]:
    """{labels: value} of one router series in a Prometheus text page."""
    series = {}
    for line in metrics.splitlines():
        if line.startswith(f"tessera_router_{name}"):
            key, _, value = line.rpartition(" ")
            series[key.removeprefix(f"tessera_router_{name}")] = float(value)
    return series


def test_the_router_takes_the_client_service_once_ready_and_routes_by_prefix(
    local_cluster_full: LocalCluster, operator: ChartOperator
) -> None:
    """spec.router turned on for a serving cluster: the router pod watches the leaders through
    the API with its ServiceAccount token and tokenizes prompts with the model's tokenizer; the
    client Service selects it as soon as its Deployment is Ready (its watch event, not the next
    resync 30 s later), and routes the second of two alike prompts by their prefix."""
    namespace = "e2e-router"
    local_cluster_full.kubectl("create", "namespace", namespace, check=False)
    ctx = Ctx(local_cluster_full, namespace)
    doc: dict[str, Any] = yaml.safe_load(yaml.safe_dump(DEMO))
    doc["metadata"]["name"] = "routed"
    doc["spec"]["parallelism"] = {"tensor": 1, "pipeline": 1}
    ctx.apply(doc)
    try:
        ctx.wait_ready("routed")
        doc["spec"]["router"] = {"enabled": True}
        ctx.apply(doc)
        deadline = time.monotonic() + 60
        while _ready_replicas(ctx, "routed-router") != 1:
            assert time.monotonic() < deadline, "the router's pod never turned Ready"
            time.sleep(0.2)
        router_ready = time.monotonic()
        while ctx.get_json("get", "svc", "routed", "-n", namespace)["spec"]["selector"] != router_selector(
            "routed"
        ):
            assert time.monotonic() - router_ready < 5, "the client Service did not move to the Ready router"
            time.sleep(0.2)

        url = local_cluster_full.expose(namespace, "routed", 8000)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2)
        # Several blocks of 16 tokens: the second request finds the first's blocks at the leader.
        prompt = "A prefix cache keeps the KV blocks of prompts it has seen. " * 6
        for _ in range(2):
            reply = client.completions.create(model=SERVED, prompt=prompt, max_tokens=4, temperature=0)
            assert reply.choices[0].text
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    finally:
        local_cluster_full.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    assert _router_series(metrics, "ready_endpoints") == {"": 1.0}  # it found the leader by watching
    decisions = _router_series(metrics, "decisions_total")
    assert decisions['{reason="prefix"}'] == 1.0 and decisions['{reason="load"}'] == 1.0, decisions
    assert _router_series(metrics, "prefix_index_entries")[""] > 0
