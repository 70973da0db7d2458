"""spec.router -> the router's Deployment, ServiceAccount, Role, RoleBinding and the client Service."""

from __future__ import annotations

import argparse
import copy

from tessera.router.cli import add_router_args
from tessera_operator import builders, naming, router_builders
from tessera_operator.reconcile.owned_plans import plan_owned, plan_services, updated_owned
from tests.operator.sim import REF, spec_of


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
