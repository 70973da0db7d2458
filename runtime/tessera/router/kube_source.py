"""The Ready leader pods of one InferenceCluster, listed then watched through the Kubernetes API
(the `kubernetes` client, on a thread: it blocks), as endpoint URLs `http://<pod IP>:<port>`."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

from tessera.router.endpoints import Publish
from tessera.router.labels import LEAVING_LABEL, leader_pod_selector

logger = logging.getLogger("tessera.router")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; the loop lists again
RETRY_S = 2.0  # after an API error


def pod_endpoint(pod: Any, port: int) -> str | None:
    """A pod's endpoint if it is Ready, not being deleted nor marked leaving, else None."""
    if pod.metadata.deletion_timestamp is not None or pod.status is None or not pod.status.pod_ip:
        return None
    if LEAVING_LABEL in (pod.metadata.labels or {}):  # its group goes: it finishes what it has
        return None
    ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or ())
    if not ready:
        return None
    ip = pod.status.pod_ip
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def default_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except OSError:
        return "default"


def load_core_api() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


class KubernetesEndpointSource:
    def __init__(
        self,
        cluster: str,
        namespace: str,
        port: int,
        core_api: Any = None,
        watch_factory: Any = None,
    ) -> None:
        self.cluster, self.namespace, self.port = cluster, namespace, port
        self.selector = leader_pod_selector(cluster)
        self._core_api = core_api
        self._watch_factory = watch_factory
        self._stop = threading.Event()

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()

        def publish_on_loop(endpoints: frozenset[str]) -> None:
            loop.call_soon_threadsafe(publish, endpoints)

        thread = threading.Thread(target=self._follow, args=(publish_on_loop,), daemon=True)
        thread.start()
        try:
            await asyncio.Event().wait()  # until cancelled; the thread publishes
        finally:
            self._stop.set()

    def _follow(self, publish: Publish) -> None:
        """List, publish, watch and publish each change; again from a list after any error."""
        api = self._core_api
        published: frozenset[str] | None = None
        while not self._stop.is_set():
            try:
                if api is None:  # in the loop: a missing config is logged and tried again
                    api = load_core_api()
                if self._watch_factory is None:
                    from kubernetes import watch

                    self._watch_factory = watch.Watch
                listing = api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                pods = {pod.metadata.name: pod_endpoint(pod, self.port) for pod in listing.items}
                published = self._publish_changed(pods, published, publish)
                stream = self._watch_factory().stream(
                    api.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=WATCH_TIMEOUT_S,
                )
                for event in stream:
                    if self._stop.is_set():
                        return
                    pod = event["object"]
                    gone = event["type"] == "DELETED"
                    pods[pod.metadata.name] = None if gone else pod_endpoint(pod, self.port)
                    published = self._publish_changed(pods, published, publish)
            except Exception as exc:  # the API server restarts, a watch expires (410): list again
                logger.warning("watching the leader pods of %s/%s: %s", self.namespace, self.cluster, exc)
                self._stop.wait(RETRY_S)
            # A watch that ended on its timeout: list again.

    @staticmethod
    def _publish_changed(
        pods: dict[str, str | None], published: frozenset[str] | None, publish: Publish
    ) -> frozenset[str]:
        endpoints = frozenset(e for e in pods.values() if e is not None)
        if endpoints != published:
            publish(endpoints)
        return endpoints
