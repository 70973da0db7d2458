"""Fixtures for the genuine local Kubernetes control plane (loaded as a plugin by the root conftest).

`k8s_cluster` (session) starts etcd + kube-apiserver + kube-controller-manager once per test run;
`k8s_namespace` gives each test a fresh namespace whose default ServiceAccount is ready for pods.
Tests using either are marked `k8s` automatically.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from e2e.local_cluster import LocalCluster, binaries_installed, install_binaries

K8S_FIXTURES = {"k8s_cluster", "k8s_namespace"}


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
    name = f"t-{uuid.uuid4().hex[:10]}"
    k8s_cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 60
    while not k8s_cluster.service_account_ready(name):
        if time.monotonic() > deadline:
            raise TimeoutError(f"default ServiceAccount in namespace {name} never got a token")
        time.sleep(0.1)
    yield name
    # The namespace controller finalizes the contents in the background.
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
