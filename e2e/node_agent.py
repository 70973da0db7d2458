"""The node agent: plays the kubelet for a few Nodes on this machine against the genuine API.

It registers its Nodes (distinct `kubernetes.io/hostname` labels, so the scheduler's placement
rules show), runs every pod bound to them (`e2e.pod_runtime`) in a network namespace of its own
(`e2e.podnet`), serves the cluster DNS to those pods (`e2e.pod_dns`), forwards their bridge's
gateway port 443 to the API server (the `kubernetes` Service that in-cluster clients find through
`KUBERNETES_SERVICE_HOST`, with the token the agent projects into their pods), writes pod status,
and finishes graceful deletions. On SIGTERM it stops every pod and removes its whole network.

    python -m e2e.node_agent --kubeconfig K --state-dir D --agent-id ab12cd --node n0 --node n1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from e2e import podnet
from e2e.kube_api import KubeApi, run_until_signalled
from e2e.local_provisioner import LocalProvisioner
from e2e.node_objects import node_object, node_ready_status
from e2e.pod_dns import API_SERVICE_NAME, DnsServer, build_records
from e2e.pod_runtime import DEFAULT_GRACE_SECONDS, PodRuntime
from e2e.service_proxy import FixedForwarder

SYNC_SECONDS = 0.3
DNS_REFRESH_SECONDS = 1.0
HEARTBEAT_SECONDS = 20.0
# On shutdown every pod gets at most this grace: `down` must not wait for a 30 s default.
SHUTDOWN_GRACE_SECONDS = 5.0
CONDITION_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
log = logging.getLogger("node-agent")


class NodeAgent:
    def __init__(self, api: KubeApi, nodes: Sequence[str], state_dir: Path, agent_id: str) -> None:
        self.api = api
        self.nodes = list(nodes)
        self.state_dir = state_dir
        self.network = podnet.PodNetwork(agent_id, len(self.nodes))
        self.dns = DnsServer()
        api_url = httpx.URL(api.server)
        self.api_forwarder = FixedForwarder(api_url.host, api_url.port or 443)
        self._api_listener: asyncio.Server | None = None
        self.pods: dict[str, PodRuntime] = {}
        self._deleting: dict[str, asyncio.Task[None]] = {}
        self.provisioner = LocalProvisioner(api, state_dir / "persistent-volumes")  # claims' folders

    async def run(self, stop: asyncio.Event) -> None:
        try:
            self.network.create()
            await self.dns.start(self.network.gateway)
            self._api_listener = await asyncio.start_server(
                self.api_forwarder.handle, self.network.gateway, podnet.API_PORT
            )
            await self._register_nodes()
            await self.provisioner.register()
            log.info("nodes %s ready, pod network 10.%d.0.0/16", self.nodes, self.network.second_octet)
            last_dns = last_heartbeat = 0.0
            while not stop.is_set():
                now = time.monotonic()
                if now - last_heartbeat > HEARTBEAT_SECONDS:
                    await self._register_nodes()
                    last_heartbeat = now
                try:
                    listed = (await self.api.get("/api/v1/pods"))["items"]
                    await self._sync_pods(listed)
                    await self.provisioner.sync()
                    if now - last_dns > DNS_REFRESH_SECONDS:
                        endpoints = (await self.api.get("/api/v1/endpoints"))["items"]
                        records = build_records(endpoints, listed)
                        # Its Endpoints hold the host's loopback: pods reach it at the gateway.
                        records[API_SERVICE_NAME] = [self.network.gateway]
                        self.dns.records = records
                        last_dns = now
                except httpx.HTTPError:
                    log.exception("sync failed; retrying")  # the apiserver restarting, say
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SYNC_SECONDS)
        finally:
            await self._shutdown()

    async def _register_nodes(self) -> None:
        for index, name in enumerate(self.nodes):
            try:
                await self.api.request("POST", "/api/v1/nodes", node_object(name))
            except httpx.HTTPStatusError as error:
                if error.response.status_code != 409:
                    raise
            status = node_ready_status(
                self.network.host_ip(index), "tessera node agent is posting ready status"
            )
            await self.api.request(
                "PATCH",
                f"/api/v1/nodes/{name}/status",
                status,
                content_type="application/strategic-merge-patch+json",
            )
            await self._clear_condition_taints(name)

    async def _clear_condition_taints(self, name: str) -> None:
        """Removes the not-ready taint the API put on the new Node: with the node lifecycle
        controller off (there is no cloud), the Ready condition alone would not lift it."""
        node = await self.api.get(f"/api/v1/nodes/{name}")
        taints = node["spec"].get("taints") or []
        kept = [t for t in taints if t["key"] not in CONDITION_TAINTS]
        if kept != taints:
            await self.api.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"taints": kept or None}})

    async def _sync_pods(self, listed: list[dict[str, Any]]) -> None:
        mine = {p["metadata"]["uid"]: p for p in listed if p["spec"].get("nodeName") in self.nodes}
        for uid, pod in mine.items():
            if pod["metadata"].get("deletionTimestamp"):
                if uid not in self._deleting:
                    self._deleting[uid] = asyncio.create_task(self._finish_deletion(pod))
            elif uid not in self.pods and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                await self._start_pod(pod)
        for uid in [uid for uid in self.pods if uid not in mine and uid not in self._deleting]:
            log.info("pod %s vanished from the API: killing it", self.pods[uid].name)
            await self.pods.pop(uid).stop(0)
        for runtime in list(self.pods.values()):
            if runtime.uid not in self._deleting:
                await runtime.tick()
                await runtime.report()

    async def _start_pod(self, pod: dict[str, Any]) -> None:
        node_index = self.nodes.index(pod["spec"]["nodeName"])
        runtime = PodRuntime(
            self.api, pod, node_index, self.network.host_ip(node_index), self.network, self.state_dir
        )
        self.pods[runtime.uid] = runtime
        log.info("starting pod %s/%s on %s", runtime.namespace, runtime.name, pod["spec"]["nodeName"])
        try:
            await runtime.start()
        except (OSError, RuntimeError) as error:  # e.g. an `ip` command failed: the pod stays Pending
            log.exception("pod %s/%s failed to start", runtime.namespace, runtime.name)
            runtime.config_error = f"sandbox: {error}"
        await runtime.report()

    async def _finish_deletion(self, pod: dict[str, Any]) -> None:
        """Graceful deletion: stop within the grace the API recorded, then remove the object."""
        meta = pod["metadata"]
        runtime = self.pods.get(meta["uid"])
        if runtime is not None:
            grace = meta.get("deletionGracePeriodSeconds")
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
            log.info("stopping pod %s/%s (grace %ss)", meta["namespace"], meta["name"], grace)
            await runtime.stop(float(grace))
            self.pods.pop(meta["uid"], None)
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
        with contextlib.suppress(httpx.HTTPStatusError):  # already gone, or a new pod of that name
            await self.api.request(
                "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body
            )
        self._deleting.pop(meta["uid"], None)

    async def _shutdown(self) -> None:
        for task in self._deleting.values():
            task.cancel()
        await asyncio.gather(
            *(runtime.stop(min(SHUTDOWN_GRACE_SECONDS, _grace(runtime))) for runtime in self.pods.values()),
            return_exceptions=True,
        )
        self.pods.clear()
        if self._api_listener is not None:
            self._api_listener.close()
        self.dns.close()
        self.network.destroy()
        log.info("stopped: every pod and the pod network are gone")


def _grace(runtime: PodRuntime) -> float:
    return float(runtime.pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.node_agent", description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", required=True, help="pod folders and container logs")
    parser.add_argument("--agent-id", required=True, help="short hex id: prefix of every netns and link")
    parser.add_argument("--node", action="append", required=True, help="a Node to register and serve")
    args = parser.parse_args(argv)
    run_until_signalled(
        args.kubeconfig,
        lambda api, stop: NodeAgent(api, args.node, Path(args.state_dir), args.agent_id).run(stop),
    )


if __name__ == "__main__":
    main()
