"""Fixtures shared by the operator's integration tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crds(k8s_cluster: Any) -> Any:
    """The generated CRDs applied with kubectl and established."""
    k8s_cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    k8s_cluster.kubectl(
        "wait", "--for", "condition=established", "crd/inferenceclusters.tessera.dev", "--timeout=60s"
    )
    return k8s_cluster
