"""spec.router -> the router's Deployment, ServiceAccount, Role, RoleBinding and the client Service."""

from __future__ import annotations

import argparse
import copy

from tessera.router.cli import add_router_args
from tessera_operator import builders, naming, router_builders
from tessera_operator.admission.validation import validate_policies
from tessera_operator.reconcile.owned_plans import plan_owned, plan_services, updated_owned
from tessera_operator.reconcile.reconciler import Reconciler
from tests.operator.sim import REF, spec_of
from tests.operator.test_reconcile_unit import IC_PATH, fake_with_cluster


def test_the_router_is_on_by_default_and_the_client_service_selects_its_pods() -> None:
    spec = spec_of()
    kinds = [o["kind"] for o in router_builders.build_router_objects(REF, spec)]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Deployment"]
    client = plan_services(REF, [], spec.router.enabled)[1].desired
    assert client["spec"]["selector"] == {
        "tessera.dev/router": "demo",
        "app.kubernetes.io/managed-by": "tessera-operator",
    }
    assert client["spec"]["ports"][0]["targetPort"] == "http"
    off = spec_of(router={"enabled": False})
    assert router_builders.build_router_objects(REF, off) == []
    leaders = plan_services(REF, [], off.router.enabled)[1].desired["spec"]["selector"]
    assert leaders == naming.rank_leader_selector("demo")


def test_the_router_runs_the_ranks_image_confined_and_its_flags_parse() -> None:
    spec = spec_of(
        router={
            "replicas": 2,
            "holdSeconds": 12.5,
            "maxHeldRequests": 9,
            "resources": {"limits": {"cpu": "1"}},
        },
        template={"image": "reg.example/tessera:1", "imagePullSecrets": ["pull"]},
    )
    deployment = router_builders.build_router_objects(REF, spec)[3]
    assert deployment["metadata"]["name"] == "demo-router"
    assert deployment["metadata"]["ownerReferences"] == [builders.owner_reference(REF)]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    # Not a rank: no cluster label on the pods, so no rank selector (Services, budget, a pass) counts it.
    assert naming.CLUSTER_LABEL not in pod["metadata"]["labels"]
    assert pod["metadata"]["labels"] == deployment["spec"]["selector"]["matchLabels"]
    pod_spec = pod["spec"]
    assert pod_spec["serviceAccountName"] == "demo-router" and pod_spec["imagePullSecrets"] == [
        {"name": "pull"}
    ]
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    [container] = pod_spec["containers"]
    assert container["image"] == "reg.example/tessera:1" and container["command"] == ["tessera", "router"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"] == {"limits": {"cpu": "1"}}
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    args = parser.parse_args(container["args"])  # the router's own flag definitions accept them
    assert (args.kube_cluster, args.kube_namespace, args.upstream_port) == ("demo", "ns", 8000)
    assert (args.hold_max, args.hold_timeout, args.block_size) == (9, 12.5, 16)
    assert args.model == "llama-3.1-8b-instruct"  # the ranks' source: prefix scoring on
    assert [v["name"] for v in pod_spec["volumes"]] == [naming.TMP_VOLUME]  # an alias: the image has it


def test_the_router_mounts_read_only_the_template_volume_that_holds_the_model_and_no_other() -> None:
    spec = spec_of(
        model={"source": "/models/llama/8b"},
        template={
            "volumes": [
                {"name": "weights", "persistentVolumeClaim": {"claimName": "llama"}},
                {"name": "scratch", "emptyDir": {}},
            ],
            "volumeMounts": [
                {"name": "weights", "mountPath": "/models/llama"},
                {"name": "scratch", "mountPath": "/models/llama-scratch"},  # a prefix, not a parent
            ],
        },
    )
    pod_spec = router_builders.build_router_objects(REF, spec)[3]["spec"]["template"]["spec"]
    assert pod_spec["volumes"][1:] == [{"name": "weights", "persistentVolumeClaim": {"claimName": "llama"}}]
    [container] = pod_spec["containers"]
    assert container["volumeMounts"][1:] == [
        {"name": "weights", "mountPath": "/models/llama", "readOnly": True}
    ]
    assert container["args"][container["args"].index("--model") + 1] == "/models/llama/8b"


def test_the_router_may_only_list_and_watch_pods_of_its_namespace() -> None:
    _, role, binding, _ = router_builders.build_router_objects(REF, spec_of())
    assert role["metadata"]["namespace"] == "ns"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "demo-router",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-router", "namespace": "ns"}]


def test_router_objects_are_rewritten_only_when_ours_changed() -> None:
    want = router_builders.build_router_objects(REF, spec_of())[3]
    assert plan_owned(REF, want, None) == "create"
    stored = copy.deepcopy(want)
    stored["metadata"].update(uid="u", resourceVersion="7")
    stored["spec"]["strategy"] = {"type": "RollingUpdate"}  # the API server's defaults: no drift
    assert plan_owned(REF, want, stored) == "keep"
    changed = router_builders.build_router_objects(REF, spec_of(router={"replicas": 3}))[3]
    assert plan_owned(REF, changed, stored) == "update"
    body = updated_owned(stored, changed)
    assert body["spec"]["replicas"] == 3 and body["metadata"]["resourceVersion"] == "7"
    assert plan_owned(REF, None, stored) == "delete" and plan_owned(REF, None, None) == "keep"
    foreign = copy.deepcopy(stored)
    foreign["metadata"]["ownerReferences"] = [{**want["metadata"]["ownerReferences"][0], "uid": "other"}]
    assert plan_owned(REF, want, foreign) == "not_ours" and plan_owned(REF, None, foreign) == "keep"
    orphan = copy.deepcopy(stored)
    orphan["metadata"]["ownerReferences"] = []
    assert plan_owned(REF, want, orphan) == "update"  # adopted


def test_with_network_policies_the_router_may_call_the_leaders() -> None:
    _, clients = builders.build_network_policies(REF, spec_of(networkPolicy={"enabled": True}))
    callers = clients["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": naming.router_selector("demo")}} in callers
    _, plain = builders.build_network_policies(
        REF, spec_of(networkPolicy={"enabled": True}, router={"enabled": False})
    )
    assert len(plain["spec"]["ingress"][0]["from"]) == 2


POOL = {"inferencePool": True, "endpointPicker": {"name": "demo-epp"}}


def test_the_inference_pool_selects_the_leaders_on_their_api_port_with_its_endpoint_picker() -> None:
    assert router_builders.build_inference_pool(REF, spec_of()) is None
    pool = router_builders.build_inference_pool(REF, spec_of(router=POOL))
    assert pool is not None
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "demo" and pool["metadata"]["ownerReferences"][0]["uid"] == REF.uid
    assert pool["spec"] == {
        "selector": {"matchLabels": naming.rank_leader_selector("demo")},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "demo-epp", "port": {"number": 9002}, "failureMode": "FailClose"},
    }
    leader = builders.build_pod(REF, spec_of(), "r", 0, 0, 0)["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= leader.items()


def test_an_inference_pool_needs_its_endpoint_picker() -> None:
    [error] = validate_policies(spec_of(router={"inferencePool": True}))
    assert error.field == "spec.router.endpointPicker"
    assert validate_policies(spec_of(router=POOL)) == []


async def test_without_the_inference_pool_crd_the_cluster_reads_degraded_and_the_router_still_runs() -> None:
    client = fake_with_cluster(router=POOL)
    await Reconciler(client, clock=lambda: 1000.0).reconcile("ns", "demo")  # type: ignore[arg-type]
    degraded = next(c for c in client.objects[IC_PATH]["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InferencePoolUnavailable"
    assert "/apis/apps/v1/namespaces/ns/deployments/demo-router" in client.objects
    client.objects["/apis/inference.networking.k8s.io/v1"] = {"kind": "APIResourceList"}  # installed now
    await Reconciler(client, clock=lambda: 1000.0).reconcile("ns", "demo")  # type: ignore[arg-type]
    assert "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools/demo" in client.objects
    degraded = next(c for c in client.objects[IC_PATH]["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"
