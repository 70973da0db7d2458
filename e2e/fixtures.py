"""Fixtures for the genuine local Kubernetes control plane (loaded as a plugin by the root conftest).

`k8s_cluster` (session) starts etcd + kube-apiserver + kube-controller-manager once per test run;
`k8s_namespace` gives each test a fresh namespace whose default ServiceAccount is ready for pods.
`local_cluster_full` (session) is the complete cluster: the same control plane plus kube-scheduler
and the node agent running pods on FULL_CLUSTER_NODES; `full_namespace` is its `k8s_namespace`.
Tests using any of them are marked `k8s` automatically.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator

import pytest

from e2e.local_cluster import LocalCluster, binaries_installed, install_binaries

K8S_FIXTURES = {"k8s_cluster", "k8s_namespace", "local_cluster_full", "full_namespace"}
# Distinct kubernetes.io/hostname labels, so placement rules (affinity, spreading) show.
FULL_CLUSTER_NODES = ("tessera-node-0", "tessera-node-1", "tessera-node-2")


@pytest.hookimpl(tryfirst=True)  # before `-m "not k8s"` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if K8S_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[LocalCluster]:
    if not binaries_installed():
        install_binaries()  # on CI `make k8s` has done this already
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture
def k8s_namespace(k8s_cluster: LocalCluster) -> Iterator[str]:
    yield from _fresh_namespace(k8s_cluster)


@pytest.fixture(scope="session")
def local_cluster_full() -> Iterator[LocalCluster]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the node agent needs root and iproute2 for pod network namespaces")
    if not binaries_installed():
        install_binaries()
    with LocalCluster(node_name=None, nodes=FULL_CLUSTER_NODES) as cluster:
        yield cluster


@pytest.fixture
def full_namespace(local_cluster_full: LocalCluster) -> Iterator[str]:
    yield from _fresh_namespace(local_cluster_full)


def _fresh_namespace(cluster: LocalCluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 60
    while not cluster.service_account_ready(name):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"default ServiceAccount or kube-root-ca.crt in namespace {name} never appeared"
            )
        time.sleep(0.1)
    yield name
    # The namespace controller finalizes the contents in the background.
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
