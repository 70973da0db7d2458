"""Endpoint sources: the static file (parsed, reloaded, a bad rewrite kept out) and the
Kubernetes source (Ready leader pods, listed then watched) over a fake API."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tessera.router.endpoints import EndpointsFileError, StaticEndpointSource
from tessera.router.kube_source import KubernetesEndpointSource, pod_endpoint


def test_the_file_names_the_line_at_fault(tmp_path: Path) -> None:
    path = tmp_path / "endpoints"
    path.write_text("# leaders\nhttp://10.0.0.1:8000/\n\nlocalhost:8000\n")
    with pytest.raises(EndpointsFileError, match=r"line 4: 'localhost:8000' is not an endpoint base URL"):
        StaticEndpointSource(file=path)
    with pytest.raises(EndpointsFileError, match="No such file"):
        StaticEndpointSource(file=tmp_path / "missing")


async def test_the_file_is_reloaded_and_a_bad_rewrite_keeps_the_last_set(tmp_path: Path) -> None:
    path = tmp_path / "endpoints"
    path.write_text("http://10.0.0.1:8000\nhttp://10.0.0.2:8000  # second\n")
    source = StaticEndpointSource(["http://10.0.0.9:1"], path, reload_interval_s=0.01)
    seen: list[frozenset[str]] = []
    task = asyncio.create_task(source.run(seen.append))
    try:
        await asyncio.sleep(0.05)
        assert seen == [frozenset({"http://10.0.0.9:1", "http://10.0.0.1:8000", "http://10.0.0.2:8000"})]
        path.write_text("not a url\n")
        await asyncio.sleep(0.05)
        assert len(seen) == 1
        path.write_text("")  # every leader gone (scaled to zero): the flags' endpoint stays
        await asyncio.sleep(0.05)
        assert seen[-1] == frozenset({"http://10.0.0.9:1"})
    finally:
        task.cancel()


def pod(name: str, ip: str | None, ready: bool, deleting: bool = False, leaving: bool = False) -> Any:
    condition = SimpleNamespace(type="Ready", status="True" if ready else "False")
    labels = {"tessera.dev/leaving": "true"} if leaving else None
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name, deletion_timestamp="now" if deleting else None, labels=labels),
        status=SimpleNamespace(pod_ip=ip, conditions=[condition]),
    )


def test_only_ready_pods_not_being_deleted_are_endpoints() -> None:
    assert pod_endpoint(pod("p", "10.1.0.4", True), 8000) == "http://10.1.0.4:8000"
    assert pod_endpoint(pod("p", "fd00::4", True), 8000) == "http://[fd00::4]:8000"
    assert pod_endpoint(pod("p", "10.1.0.4", False), 8000) is None
    assert pod_endpoint(pod("p", "10.1.0.4", True, deleting=True), 8000) is None
    assert pod_endpoint(pod("p", None, True), 8000) is None
    assert pod_endpoint(pod("p", "10.1.0.4", True, leaving=True), 8000) is None  # marked by the operator


class FakeCoreApi:
    def __init__(self, pods: list[Any]) -> None:
        self.pods = pods
        self.selectors: list[str] = []

    def list_namespaced_pod(self, namespace: str, label_selector: str, **_: Any) -> Any:
        self.selectors.append(label_selector)
        return SimpleNamespace(items=self.pods, metadata=SimpleNamespace(resource_version="7"))


class FakeWatch:
    """Yields the given events, then blocks as a quiet watch does (until the test ends)."""

    def __init__(self, events: list[dict[str, Any]], done: threading.Event) -> None:
        self.events, self.done = events, done

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        assert kwargs["resource_version"] == "7"
        yield from self.events
        self.done.wait(5)


async def test_the_kubernetes_source_follows_ready_leaders() -> None:
    api = FakeCoreApi([pod("c-g0-s0-t0", "10.1.0.1", True), pod("c-g1-s0-t0", "10.1.0.2", False)])
    events = [
        {"type": "MODIFIED", "object": pod("c-g1-s0-t0", "10.1.0.2", True)},  # became Ready
        {"type": "DELETED", "object": pod("c-g0-s0-t0", "10.1.0.1", True)},
    ]
    done = threading.Event()
    source = KubernetesEndpointSource("c", "ns", 8000, api, lambda: FakeWatch(events, done))
    seen: list[frozenset[str]] = []
    task = asyncio.create_task(source.run(seen.append))
    try:
        for _ in range(100):
            if len(seen) == 3:
                break
            await asyncio.sleep(0.02)
        assert seen == [
            frozenset({"http://10.1.0.1:8000"}),
            frozenset({"http://10.1.0.1:8000", "http://10.1.0.2:8000"}),
            frozenset({"http://10.1.0.2:8000"}),
        ]
        assert api.selectors[0] == (
            "tessera.dev/cluster=c,app.kubernetes.io/managed-by=tessera-operator,tessera.dev/role=leader"
        )
    finally:
        done.set()
        task.cancel()
