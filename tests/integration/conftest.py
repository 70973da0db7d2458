"""Fixtures shared by the operator's integration tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The Gateway API inference extension's InferencePool (spec.router.inferencePool), as little of its
# CRD as the API server needs. Applied with ours, at once: a CRD added later makes the garbage
# collector resync its kinds, which holds every collection up to 30 s.
INFERENCE_POOL_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {
        "name": "inferencepools.inference.networking.k8s.io",
        # A *.k8s.io group needs it (the extension's own CRD carries its approval's URL).
        "annotations": {"api-approved.kubernetes.io": "unapproved, a test's stand-in"},
    },
    "spec": {
        "group": "inference.networking.k8s.io",
        "scope": "Namespaced",
        "names": {"plural": "inferencepools", "singular": "inferencepool", "kind": "InferencePool"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


@pytest.fixture(scope="module")
def crds(k8s_cluster: Any) -> Any:
    """The generated CRDs applied with kubectl and established, and a stand-in InferencePool CRD."""
    k8s_cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(INFERENCE_POOL_CRD))
    for crd in ("inferenceclusters.tessera.dev", "inferencepools.inference.networking.k8s.io"):
        k8s_cluster.kubectl("wait", "--for", "condition=established", f"crd/{crd}", "--timeout=60s")
    return k8s_cluster
