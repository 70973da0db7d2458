"""Admission on the genuine API server: the schema, the kopf webhook, the chart's RBAC."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tessera.ports import free_port
from tests.integration.operator_harness import (
    CHART,
    ROOT,
    condition,
    ic,
    kjson,
    pod_names,
    running_operator,
    wait_for,
)


def manifest(**spec: Any) -> str:
    base: dict[str, Any] = {
        "model": {"source": "smollm2-135m-instruct"},
        "parallelism": {"tensor": 3, "pipeline": 2},
    }
    base.update(spec)
    return yaml.safe_dump(
        {
            "apiVersion": "tessera.dev/v1alpha1",
            "kind": "InferenceCluster",
            "metadata": {"name": "bad"},
            "spec": base,
        }
    )


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"replicas": -1}, "spec.replicas"),
        ({"parallelism": {"tensor": "two"}}, "spec.parallelism.tensor"),
        ({"placement": {"mode": "sometimes"}}, "spec.placement.mode"),
        ({"engine": {"kvCacheMemory": "lots"}}, "spec.engine.kvCacheMemory"),
        ({"engine": {"samplingDefaults": {"topP": 0}}}, "spec.engine.samplingDefaults.topP"),
        ({"template": {"gpusPerRank": 2}}, "spec.template.gpusPerRank"),
        # A list keyed by name, as a pod's env: one entry per name.
        (
            {"template": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
            "spec.template.env[1]",
        ),
    ],
)
def test_schema_rejects_types_and_ranges(
    crds: Any, k8s_namespace: str, spec: dict[str, Any], field: str
) -> None:
    result = crds.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=manifest(**spec), check=False)
    assert result.returncode != 0 and field in result.stderr, result.stderr


def test_kv_cache_memory_takes_any_quantity_as_kubernetes_does(crds: Any, k8s_namespace: str) -> None:
    # A plain number of bytes (int-or-string) and Kubernetes' own spellings, all past the schema.
    for value in (1073741824, "1e+9", ".5Gi", "2Gi", "1500M"):
        crds.kubectl(
            "apply", "--dry-run=server", "-n", k8s_namespace, "-f", "-",
            input=manifest(engine={"kvCacheMemory": value}),
        )  # fmt: skip


def test_a_new_object_reads_as_reconciling_until_an_operator_writes_its_status(
    crds: Any, k8s_namespace: str
) -> None:
    # No operator runs here: kstatus (Flux's `wait: true`, kpt) must not read the object as Current.
    crds.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=manifest())
    status = kjson(crds, "get", "ic", "bad", "-n", k8s_namespace)["status"]
    [condition] = status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "Reconciling",
        "True",
        "AwaitingOperator",
    )
    assert "observedGeneration" not in status


def test_examples_pass_server_side_validation(crds: Any, k8s_namespace: str) -> None:
    for example in ("smollm2.yaml", "llama-70b-gpu.yaml", "networkpolicy.yaml"):
        crds.kubectl("apply", "--dry-run=server", "-n", k8s_namespace, "-f", str(ROOT / "examples" / example))
    # The HPA on the scale subresource: autoscaling/v2 from Kubernetes 1.23, the same fields in
    # v2beta2 before (the test's API server may be older).
    hpa = yaml.safe_load((ROOT / "examples" / "autoscaling" / "hpa.yaml").read_text())
    if "autoscaling/v2" not in crds.kubectl("api-versions").stdout.split():
        hpa["apiVersion"] = "autoscaling/v2beta2"
    crds.kubectl("apply", "--dry-run=server", "-n", k8s_namespace, "-f", "-", input=yaml.safe_dump(hpa))


WEBHOOK_VALUES = (
    "--set",
    "webhook.enabled=true",
    "--set",
    "webhook.clientAuth.names={kube-apiserver-webhook-client}",
)


def deep_manifest(levels: int) -> str:
    """An object whose spec.template.affinity nests `levels` objects deep (JSON written as text:
    Python's own encoder gives up at about 1000 levels)."""
    affinity = '{"a":' * (levels - 1) + "{}" + "}" * (levels - 1)
    return (
        '{"apiVersion": "tessera.dev/v1alpha1", "kind": "InferenceCluster", "metadata": {"name": "deep"}, '
        '"spec": {"model": {"source": "smollm2-135m-instruct"}, "template": {"affinity": ' + affinity + "}}}"
    )


def deep_review(ns: str, levels: int) -> bytes:
    review = json.dumps(admission_review(ns))
    marker = '"template": {}'
    head = review.replace('"spec": {', '"spec": {"template": {}, ', 1)
    affinity = '{"a":' * (levels - 1) + "{}" + "}" * (levels - 1)
    return head.replace(marker, '"template": {"affinity": ' + affinity + "}", 1).encode()


def admission_review(ns: str) -> dict[str, Any]:
    obj = yaml.safe_load(manifest())
    obj["metadata"]["namespace"] = ns
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "forged",
            "operation": "CREATE",
            "namespace": ns,
            "userInfo": {"username": "intruder"},
            "resource": {"group": "tessera.dev", "version": "v1alpha1", "resource": "inferenceclusters"},
            "object": obj,
        },
    }


def post_review(port: int, body: bytes, pair: tuple[str, str] | None) -> tuple[int, str]:
    """A review POSTed straight at the webhook, as any pod could; the server's certificate is not
    what this checks (it is self-signed), the client's is."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    if pair is not None:
        context.load_cert_chain(*pair)
    request = urllib.request.Request(
        f"https://127.0.0.1:{port}/tessera-validate", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def other_webhook_configuration(name: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
        }
    )


def test_webhook_rejects_cross_field_errors_naming_the_field(crds: Any, k8s_namespace: str) -> None:
    """The operator keeps its own ValidatingWebhookConfiguration current with the chart's RBAC, and no other."""
    cluster, ns = crds, k8s_namespace
    config_name = f"{ns}-operator-{ns}.tessera.dev"  # the chart's name for release `ns` in `ns`
    other = f"{ns}-other.example.com"
    port = free_port()
    args = (
        "--webhook-port", str(port), "--webhook-addr", "127.0.0.1", "--webhook-host", "127.0.0.1",
        "--webhook-managed", config_name,
        # The local API server presents this client certificate to webhooks (e2e/local_cluster.py).
        "--webhook-client-ca", cluster.webhook_client_ca, "--webhook-client-names", cluster.webhook_client_name,
    )  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=other_webhook_configuration(other))
    try:
        with running_operator(
            cluster, ns, *args, rbac_extra=WEBHOOK_VALUES, templates=("webhook.yaml",)
        ) as operator:
            live = wait_for(
                lambda: kjson(cluster, "get", "validatingwebhookconfiguration", config_name).get("webhooks"),
                "the operator registered its webhook",
            )
            assert [rule["operations"] for rule in live[0]["rules"]] == [["CREATE", "UPDATE"]]
            cases: list[tuple[dict[str, Any], str]] = [
                (
                    {"parallelism": {"tensor": 3, "pipeline": 2, "layerPartition": [30]}},
                    "spec.parallelism.layerPartition",
                ),
                (
                    {"parallelism": {"tensor": 1, "pipeline": 2, "sequenceParallel": True}},
                    "spec.parallelism.sequenceParallel",
                ),
                (
                    {"parallelism": {"tensor": 3, "pipeline": 2, "layerPartition": [15, 14]}},
                    "spec.parallelism.layerPartition",
                ),
                ({"parallelism": {"tensor": 2}}, "spec.parallelism.tensor"),  # 9 heads do not split over 2
                (  # SmolLM2 has no experts (a CRD without the field: kubectl refuses it, not the webhook)
                    {"parallelism": {"tensor": 3, "pipeline": 2, "expertParallel": True}},
                    "spec.parallelism.expertParallel",
                ),
                ({"rollout": {"maxUnavailable": 0, "maxSurge": 0}}, "spec.rollout.maxUnavailable"),
                ({"engine": {"kvCacheMemory": "1e400"}}, "spec.engine.kvCacheMemory"),
                ({"parallelism": {"tensor": 64, "pipeline": 30}}, "spec.replicas"),
                ({"template": {"serviceAccountName": "admin"}}, "spec.template.serviceAccountName"),
                (
                    {"template": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
                    "spec.template.volumes[0].hostPath",
                ),
                (
                    {
                        "template": {
                            "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
                        }
                    },
                    "spec.template.env[0].valueFrom.secretKeyRef",
                ),
                (
                    {"template": {"resources": {"limits": {"memory": "1e400"}}}},
                    "spec.template.resources.limits",
                ),
                (  # only the API server's own pod validation knows this field path (a dry run)
                    {"template": {"env": [{"name": "P", "valueFrom": {"fieldRef": {"fieldPath": "nope"}}}]}},
                    "valueFrom.fieldRef.fieldPath",
                ),
            ]
            for spec, field in cases:

                def rejected(spec: dict[str, Any] = spec) -> Any:
                    r = cluster.kubectl("apply", "-n", ns, "-f", "-", input=manifest(**spec), check=False)
                    return r if r.returncode != 0 else None

                result = wait_for(rejected, f"rejection of {field}", timeout=15)
                assert field in result.stderr and "denied" in result.stderr, result.stderr
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=manifest())  # a valid object passes
            cluster.kubectl("delete", "ic", "bad", "-n", ns)  # DELETE is never sent to the webhook

            # The chart's RBAC: enough to keep its own configuration, nothing over any other.
            as_operator = operator.kubeconfig
            for attempt in (
                ("patch", "validatingwebhookconfiguration", other, "--type=merge", "-p", '{"webhooks": []}'),
                ("delete", "validatingwebhookconfiguration", config_name),
                ("get", "validatingwebhookconfigurations"),
            ):
                r = cluster.kubectl(*attempt, kubeconfig=as_operator, check=False)
                assert r.returncode != 0 and "forbidden" in r.stderr.lower(), (attempt, r.stderr)
            r = cluster.kubectl(
                "create",
                "-f",
                "-",
                input=other_webhook_configuration(f"{ns}-new"),
                kubeconfig=as_operator,
                check=False,
            )
            assert r.returncode != 0 and "forbidden" in r.stderr.lower(), r.stderr
            # Nobody but the API server gets a review judged: without a client certificate the TLS
            # handshake fails; with one the same cluster CA signed (the operator's own), 403.
            review = json.dumps(admission_review(ns)).encode()
            with pytest.raises(OSError):
                post_review(port, review, None)
            credentials = yaml.safe_load(Path(operator.kubeconfig).read_text())["users"][0]["user"]
            pair = (credentials["client-certificate"], credentials["client-key"])
            assert post_review(port, review, pair)[0] == 403
            # Free-form fields nested too deep, sent with the API server's own client certificate
            # (kube-apiserver 1.20 itself times out storing such an object, 34 s, so kubectl cannot
            # bring one here): at 300 levels denied naming the field, at 1500 (past Python's JSON
            # decoder) still denied, never a crash.
            pki = Path(cluster.webhook_client_ca).parent
            api_server = (
                str(pki / "apiserver-webhook-client.crt"),
                str(pki / "apiserver-webhook-client.key"),
            )
            for levels, said in ((300, "spec.template.affinity"), (1500, "nests too deeply to be judged")):
                status, text = post_review(port, deep_review(ns, levels), api_server)
                answer = json.loads(text)["response"]
                assert status == 200 and answer["allowed"] is False, text[-2000:]
                assert said in answer["status"]["message"] and "may nest at most 32 levels" in text
        # Stopped: like kopf, it leaves no webhook behind that nothing serves.
        assert not kjson(cluster, "get", "validatingwebhookconfiguration", config_name).get("webhooks")
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", config_name, other, "--ignore-not-found")


def test_without_the_webhook_the_operator_still_refuses_an_invalid_spec(
    crds: Any, k8s_namespace: str
) -> None:
    cluster, ns = crds, k8s_namespace
    with running_operator(cluster, ns):
        cluster.kubectl(
            "apply", "-n", ns, "-f", "-",
            input=manifest(parallelism={"tensor": 1, "pipeline": 2, "layerPartition": [10, 10]}),
        )  # fmt: skip
        degraded = wait_for(lambda: condition(ic(cluster, ns, "bad"), "Degraded"), "Degraded condition")
        assert (
            degraded["reason"] == "InvalidSpec" and "spec.parallelism.layerPartition" in degraded["message"]
        )
        assert not pod_names(cluster, ns)


def test_helm_install_grants_least_privilege(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    helm = str(cluster.bin_dir / "helm")
    release = f"r{ns[-8:]}"
    run = subprocess.run(
        [
            helm,
            "install",
            release,
            str(CHART),
            "-n",
            ns,
            "--set",
            f"watch.namespaces={{{ns}}}",
            *WEBHOOK_VALUES,
        ],
        capture_output=True,
        text=True,
        env=cluster.env,
    )
    assert run.returncode == 0, run.stderr
    try:
        sa = f"system:serviceaccount:{ns}:{release}-operator"

        def can(verb: str, resource: str, namespace: str) -> bool:
            words = resource.split()  # e.g. "inferenceclusters.tessera.dev --subresource=status"
            result = cluster.kubectl("auth", "can-i", verb, *words, "-n", namespace, "--as", sa, check=False)
            return result.stdout.strip() == "yes"

        assert can("create", "pods", ns) and can(
            "patch", "inferenceclusters.tessera.dev --subresource=status", ns
        )
        assert can("watch", "inferenceclusters.tessera.dev", ns) and can("create", "events", ns)
        assert not can("create", "pods", "default")  # namespace-scoped install
        assert not can("delete", "inferenceclusters.tessera.dev", ns)
        # Its one Secret of group secrets, by name: no list or watch of the namespace's Secrets.
        assert can("create", "secrets", ns) and can("get", "secrets", ns)
        assert not can("list", "secrets", ns) and not can("watch", "secrets", ns)
        assert not can("delete", "secrets", ns)
        # spec.router's Deployment, ServiceAccount, Role and RoleBinding, by name: its Role grants
        # rights the operator holds (no escalate, no bind), and no list of the namespace's.
        rbac = "rbac.authorization.k8s.io"
        assert can("create", "deployments.apps", ns) and can("update", f"roles.{rbac}", ns)
        assert can("create", f"rolebindings.{rbac}", ns) and can("delete", "serviceaccounts", ns)
        assert not can("escalate", f"roles.{rbac}", ns) and not can("bind", f"roles.{rbac}", ns)
        assert not can("list", f"roles.{rbac}", ns) and not can("list", "serviceaccounts", ns)
        assert can("watch", "deployments.apps", ns)  # the router's turning Ready moves the Service
        own = f"validatingwebhookconfigurations/{release}-operator-{ns}.tessera.dev"
        assert can("patch", own, ns) and not can("delete", own, ns)
        assert not can("patch", "validatingwebhookconfigurations/someone-elses", ns)
        assert not can("create", "validatingwebhookconfigurations", ns)
        assert not can("list", "validatingwebhookconfigurations", ns)
        deployment = cluster.kubectl("get", "deploy", f"{release}-operator", "-n", ns, "-o", "yaml").stdout
        spec = yaml.safe_load(deployment)["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    finally:
        subprocess.run([helm, "uninstall", release, "-n", ns], capture_output=True, env=cluster.env)
