"""The Helm chart renders least-privilege RBAC for each mode (helm from the k8s binary cache)."""

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.local_cluster import default_bin_dir
from tessera_operator.__main__ import parse_args
from tessera_operator.admission import webhook

CHART = Path(__file__).resolve().parents[2] / "charts" / "tessera"
HELM = default_bin_dir() / "helm"
pytestmark = pytest.mark.skipif(not HELM.exists(), reason="helm not installed (make k8s)")


# The name of the API server's webhook client certificate (a webhook needs one, or `insecure`).
CLIENT_NAMES = "webhook.clientAuth.names={kube-apiserver-webhook-client}"


def render(
    *sets: str,
    release: str = "rel",
    namespace: str = "ops",
    values: Path | None = None,
    client_auth: bool = True,
) -> list[dict[str, Any]]:
    args = [str(HELM), "template", release, str(CHART), "-n", namespace, "--include-crds"]
    if values is not None:
        args += ["-f", str(values)]
    for value in (CLIENT_NAMES, *sets) if client_auth else sets:
        args += ["--set", value]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def kinds(docs: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    return sorted((d["kind"], d["metadata"].get("namespace")) for d in docs)


def test_namespaced_mode_grants_pods_only_through_roles() -> None:
    docs = render("watch.namespaces={a,b}")
    assert ("Role", "a") in kinds(docs) and ("Role", "b") in kinds(docs)
    cluster_rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert {res for r in cluster_rules for res in r["resources"]} == {
        "customresourcedefinitions",
        "namespaces",
        "storageclasses",  # spec.model.cache: whether the named class exists (get only)
    }
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in cluster_rules)
    [classes] = [r for r in cluster_rules if "storageclasses" in r["resources"]]
    assert classes["verbs"] == ["get"]
    role_rules = [r for d in docs if d["kind"] == "Role" for r in d["rules"]]
    [claims] = {json.dumps(r) for r in role_rules if "persistentvolumeclaims" in r["resources"]}
    assert set(json.loads(claims)["verbs"]) == {"get", "create", "patch", "delete"}  # no list, watch, update
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=a" in container["args"] and "--namespace=b" in container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deploy["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert any(d["kind"] == "CustomResourceDefinition" for d in docs)


def test_cluster_wide_mode_and_managed_webhook() -> None:
    docs = render("watch.clusterWide=true", "webhook.enabled=true")
    # No Role but the leader election's, in the operator's namespace, on leases only.
    roles = [d for d in docs if d["kind"] == "Role"]
    assert [r["metadata"]["name"] for r in roles] == ["rel-operator-leader-election"]
    assert {res for r in roles[0]["rules"] for res in r["resources"]} == {"leases"}
    rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert any("pods" in r["resources"] and "create" in r["verbs"] for r in rules)
    # Its own webhook configuration (created by the chart, empty) and no other: no create, list, watch.
    [webhook_rule] = [r for r in rules if "validatingwebhookconfigurations" in r["resources"]]
    assert webhook_rule["resourceNames"] == ["rel-operator-ops.tessera.dev"] and webhook_rule["verbs"] == [
        "patch"
    ]
    [config] = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    assert config["metadata"]["name"] == "rel-operator-ops.tessera.dev" and "webhooks" not in config
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    assert "--all-namespaces" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_static_webhook_configuration_has_the_operators_rules() -> None:
    docs = render(
        "webhook.enabled=true", "webhook.managed=false", "webhook.caBundle=Zm9v", "webhook.certSecret=tls"
    )
    [config] = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    [hook] = config["webhooks"]
    [managed] = webhook.webhooks({"url": "https://operator:9443"})
    assert hook["rules"] == managed["rules"] and hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    assert hook["clientConfig"]["service"]["path"] == "/" + webhook.HANDLER_ID
    assert managed["clientConfig"]["url"] == "https://operator:9443/" + webhook.HANDLER_ID


def test_a_static_webhook_needs_the_certificate_its_ca_bundle_signs() -> None:
    with pytest.raises(subprocess.CalledProcessError) as refused:
        render("webhook.enabled=true", "webhook.managed=false", "webhook.caBundle=Zm9v")
    assert "webhook.certSecret is required" in refused.value.stderr


def test_the_managed_webhook_names_the_charts_service_with_its_failure_policy() -> None:
    """The API server may not resolve in-cluster names (it often runs on the host network): the
    configuration the operator writes must point at the Service, not at kopf's `.svc` URL."""
    docs = render("webhook.enabled=true", "webhook.failurePolicy=Ignore")
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    args = dict(
        a.split("=", 1) for a in deploy["spec"]["template"]["spec"]["containers"][0]["args"] if "=" in a
    )
    [service] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-webhook")]
    url = f"https://{args['--webhook-host']}:{args['--webhook-port']}"
    [hook] = webhook.webhooks(
        {"url": url, "caBundle": "Q0E="}, args["--webhook-service"], args["--webhook-failure-policy"]
    )
    assert hook["clientConfig"] == {
        "caBundle": "Q0E=",
        "service": {
            "namespace": service["metadata"]["namespace"],
            "name": service["metadata"]["name"],
            "port": service["spec"]["ports"][0]["port"],
            "path": "/" + webhook.HANDLER_ID,
        },
    }
    assert hook["failurePolicy"] == "Ignore"


def test_pod_policy_values_become_operator_flags() -> None:
    def args(*sets: str) -> list[str]:
        [deploy] = [d for d in render(*sets) if d["kind"] == "Deployment"]
        return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"])

    strict = args()
    assert "--max-pods-per-cluster=1024" in strict
    assert not [a for a in strict if a.startswith(("--allow-", "--allowed-"))]
    opened = args(
        "podPolicy.allowHostPath=true",
        "podPolicy.allowSecrets=true",
        "podPolicy.allowedSecrets={api-key}",
        "podPolicy.allowedServiceAccounts={inference,batch}",
        "podPolicy.allowedPriorityClasses={high}",
        "podPolicy.maxPodsPerCluster=4096",
    )
    assert {"--allow-host-path", "--allow-secrets", "--allowed-service-accounts=inference,batch"} <= set(
        opened
    )
    assert {"--allowed-priority-classes=high", "--max-pods-per-cluster=4096"} <= set(opened)
    parsed = parse_args([a for a in opened if a.startswith(("--allow", "--max-pods"))])
    assert parsed.allowed_service_accounts == {"inference", "batch"} and parsed.max_pods_per_cluster == 4096
    assert parsed.allowed_secrets == {"api-key"}


def refusal(*sets: str) -> str:
    with pytest.raises(subprocess.CalledProcessError) as refused:
        render(*sets)
    return str(refused.value.stderr)


def test_bad_values_are_refused_naming_the_value() -> None:
    """values.schema.json: what would crash-loop the operator or quietly disable it fails at render."""
    assert "/operator/workers" in refusal("operator.workers=abc")
    assert "/webhook/failurePolicy" in refusal("webhook.failurePolicy=Foo")
    assert "/operator/autoscaleIntervalSeconds" in refusal("operator.autoscaleIntervalSeconds=-5")
    assert "/podPolicy/maxPodsPerCluster" in refusal("podPolicy.maxPodsPerCluster=0")
    assert "/watch/namespaces/0" in refusal("watch.namespaces={Team_A}")
    assert "/operator/logLevel" in refusal("operator.logLevel=trace")
    # Never the namespace's `default` account: every pod there would get the operator's rights.
    assert "serviceAccount.name is required" in refusal("serviceAccount.create=false")
    # A scope that looks narrow but is not: cluster-wide rights, every namespace watched.
    assert "watch.namespaces" in refusal("watch.clusterWide=true", "watch.namespaces={team-a}")
    # Both servers would bind one port: the second fails and the operator stops.
    assert "the same port" in refusal("webhook.enabled=true", "operator.healthPort=9443")


def test_large_numbers_reach_the_operator_as_integers(tmp_path: Path) -> None:
    """YAML numbers are floats to Helm: 10000000 printed as is would be 1e+07, which no int flag takes."""
    values = tmp_path / "values.yaml"
    values.write_text(
        "operator: {workers: 10000000, concurrency: 2000000, healthPort: 8081}\nwebhook: {port: 9443}\n"
    )
    docs = render("webhook.enabled=true", values=values)
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    options = parse_args([a for a in args if a.startswith(("--workers", "--concurrency", "--webhook-port"))])
    assert (options.workers, options.concurrency, options.webhook_port) == (10000000, 2000000, 9443)
    assert "--workers=10000000" in args and "--webhook-port=9443" in args


def test_pod_labels_add_to_the_charts_own_and_never_replace_them() -> None:
    # A duplicate key (the chart's and the value's) made the API server refuse the Deployment.
    docs = render("podLabels.team=ml", "podLabels.helm\\.sh/chart=mine")
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "ml" and labels["helm.sh/chart"].startswith("tessera-")
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "/podLabels" in refusal("podLabels.app\\.kubernetes\\.io/name=mine")


def test_two_releases_of_one_name_in_two_namespaces_share_no_cluster_scoped_object() -> None:
    def cluster_scoped(namespace: str) -> set[tuple[str, str]]:
        docs = render("webhook.enabled=true", "watch.clusterWide=true", namespace=namespace)
        return {(d["kind"], d["metadata"]["name"]) for d in docs if "namespace" not in d["metadata"]}

    team_a, team_b = cluster_scoped("team-a"), cluster_scoped("team-b")
    crd = {kind_name for kind_name in team_a if kind_name[0] == "CustomResourceDefinition"}
    assert crd and team_a & team_b == crd  # the CRD alone is shared, as it must be
    assert {k for k, _ in team_a} >= {"ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration"}


@pytest.mark.parametrize("release", ["r" * 52, "my.release", "1st"])
def test_any_release_name_keeps_the_webhook_service_a_valid_name(release: str) -> None:
    """A Service name is a DNS-1035 label: at most 63 characters, no dots, a letter first."""
    docs = render("webhook.enabled=true", release=release)
    [service] = [d for d in docs if d["kind"] == "Service"]
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", service["metadata"]["name"])
    assert f"--webhook-service=ops/{service['metadata']['name']}" in args


def test_the_webhook_namespace_selector_reaches_both_configurations() -> None:
    selector = "webhook.namespaceSelector.matchLabels.team=a"
    [deploy] = [d for d in render("webhook.enabled=true", selector) if d["kind"] == "Deployment"]
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    flag = next(a for a in args if a.startswith("--webhook-namespace-selector="))
    parsed = parse_args([flag])
    assert parsed.webhook_namespace_selector == {"matchLabels": {"team": "a"}}
    static = render(
        "webhook.enabled=true",
        "webhook.managed=false",
        "webhook.caBundle=Zm9v",
        "webhook.certSecret=tls",
        selector,
    )
    [config] = [d for d in static if d["kind"] == "ValidatingWebhookConfiguration"]
    assert config["webhooks"][0]["namespaceSelector"] == {"matchLabels": {"team": "a"}}


def test_the_image_defaults_to_the_charts_app_version_and_takes_pull_secrets() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())

    def pod(*sets: str) -> dict[str, Any]:
        [deploy] = [d for d in render(*sets) if d["kind"] == "Deployment"]
        return dict(deploy["spec"]["template"]["spec"])

    assert pod()["containers"][0]["image"] == f"localhost/tessera/operator:{chart['appVersion']}"
    digest = "sha256:" + "a" * 64
    assert pod(f"image.digest={digest}")["containers"][0]["image"] == f"localhost/tessera/operator@{digest}"
    assert pod("imagePullSecrets[0].name=regcred")["imagePullSecrets"] == [{"name": "regcred"}]


def test_operator_flags_refuse_what_would_spin_or_stall_it() -> None:
    for flag in ("--autoscale-interval=-5", "--workers=0", "--max-pods-per-cluster=0", "--resync-seconds=0"):
        with pytest.raises(SystemExit):
            parse_args([flag])
    with pytest.raises(SystemExit):
        parse_args(['--webhook-namespace-selector={"team": "a"}'])  # not a LabelSelector


def test_the_operator_refuses_to_start_without_a_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither -n nor -A: kopf would quietly watch the whole cluster with namespaced RBAC."""
    from tessera_operator import __main__ as cli

    monkeypatch.setattr(cli.CONFIG, "namespaces", [])
    with pytest.raises(SystemExit, match="-n NAMESPACE"):
        cli.main([])


def container_args(docs: list[dict[str, Any]]) -> list[str]:
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"])


def test_the_webhook_takes_reviews_only_from_the_api_servers_client_certificate() -> None:
    """By default the cluster CA (the ServiceAccount's ca.crt) and the names given; the chart
    refuses a webhook that would take reviews from anyone unless told so by name."""
    args = container_args(render("webhook.enabled=true"))
    assert "--webhook-client-ca=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt" in args
    assert "--webhook-client-names=kube-apiserver-webhook-client" in args
    assert "--webhook-max-in-flight=4" in args and "--webhook-insecure-skip-client-auth" not in args
    refused = subprocess.run(
        [str(HELM), "template", "r", str(CHART), "--set", "webhook.enabled=true"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "webhook.clientAuth.names" in refused.stderr
    insecure = container_args(
        render("webhook.enabled=true", "webhook.clientAuth.insecure=true", client_auth=False)
    )
    assert "--webhook-insecure-skip-client-auth" in insecure
    assert not [a for a in insecure if a.startswith("--webhook-client-")]
    assert not [a for a in container_args(render()) if a.startswith("--webhook")]  # webhook off


def test_a_client_ca_bundle_is_mounted_from_a_config_map(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    values.write_text(yaml.safe_dump({"webhook": {"clientAuth": {"caBundle": pem}}}))
    docs = render("webhook.enabled=true", "webhook.maxInFlight=2", values=values)
    [config_map] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config_map["data"] == {"ca.crt": pem}
    args = container_args(docs)
    assert (
        "--webhook-client-ca=/etc/tessera/webhook-client-ca/ca.crt" in args
        and "--webhook-max-in-flight=2" in args
    )
    parsed = parse_args([a for a in args if a.startswith("--webhook-client-names")])
    assert parsed.webhook_client_names == frozenset({"kube-apiserver-webhook-client"})
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    assert {"name": "webhook-client-ca", "configMap": {"name": config_map["metadata"]["name"]}} in pod[
        "volumes"
    ]


def test_control_plane_nodes_are_opened_by_a_pod_policy_value() -> None:
    assert "--allow-control-plane" in container_args(render("podPolicy.allowControlPlane=true"))
    assert "--allow-control-plane" not in container_args(render())


def test_two_replicas_elect_a_leader_by_default_and_spread_across_nodes() -> None:
    docs = render()
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    spec, pod = deploy["spec"], deploy["spec"]["template"]["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    args = pod["containers"][0]["args"]
    assert "--leader-elect" in args and "--leader-elect-resource-namespace=ops" in args
    assert "--leader-elect-resource-name=rel-operator" in args
    # The flags the chart passes are the operator's own, and the durations keep their order.
    parsed = parse_args(args)
    assert parsed.leader_elect and parsed.renew_deadline_seconds < parsed.lease_duration_seconds
    assert pod["containers"][0]["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    [term] = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    [pdb] = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1
    # The Lease: get and update on its name only; create cannot be limited by name (RBAC).
    [role] = [
        d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "rel-operator-leader-election"
    ]
    assert role["metadata"]["namespace"] == "ops"
    named, create = role["rules"]
    assert named["resourceNames"] == ["rel-operator"] and named["verbs"] == ["get", "update"]
    assert "resourceNames" not in create and create["verbs"] == ["create"]


def test_replicas_without_leader_election_are_refused_and_one_recreates() -> None:
    assert "leaderElection.enabled" in refusal("leaderElection.enabled=false")
    assert "less than leaseDurationSeconds" in refusal("leaderElection.renewDeadlineSeconds=15")
    docs = render("leaderElection.enabled=false", "replicaCount=1")
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    assert deploy["spec"]["strategy"]["type"] == "Recreate"
    assert "--leader-elect" not in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [
        d for d in docs if d["kind"] == "PodDisruptionBudget" or "leader-election" in d["metadata"]["name"]
    ]
