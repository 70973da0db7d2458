"""Fixtures shared by the operator's integration tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The Gateway API inference extension's InferencePool (spec.router.inferencePool), its released
# v1 spec schema. Applied with ours, at once: a CRD added later makes the garbage collector resync
# its kinds, which holds every collection up to 30 s.
INFERENCE_POOL_CRD = ROOT / "tests" / "fixtures" / "inference_pool_v1_crd.yaml"


@pytest.fixture(scope="module")
def crds(k8s_cluster: Any) -> Any:
    """The generated CRDs applied with kubectl and established, and the InferencePool CRD."""
    k8s_cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    k8s_cluster.kubectl("apply", "-f", str(INFERENCE_POOL_CRD))
    for crd in ("inferenceclusters.tessera.dev", "inferencepools.inference.networking.k8s.io"):
        k8s_cluster.kubectl("wait", "--for", "condition=established", f"crd/{crd}", "--timeout=60s")
    return k8s_cluster
