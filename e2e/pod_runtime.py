"""One pod on the node agent: its sandbox, its containers as local process groups, probes, status.

Each container runs as `ip netns exec <netns> unshare --uts --mount -- sh -c 'MOUNTS; hostname H;
exec CMD'` in a session of its own, so its whole process tree shares one process group that can be
signalled, and sees its volumes (`e2e.pod_mounts`) in a mount namespace that dies with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from e2e import pod_init, pod_mounts, podnet
from e2e.container_spec import ContainerConfigError, api_service_env, container_argv, container_env
from e2e.kube_api import KubeApi

BACKOFF_INITIAL_SECONDS = 1.0  # the kubelet starts at 10 s; tests should not wait that long
BACKOFF_MAX_SECONDS = 20.0
DEFAULT_GRACE_SECONDS = 30
CONFIG_RETRY_SECONDS = 2.0
_SET_HOSTNAME_AND_EXEC = 'hostname "$0" && exec "$@"'


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Probe:
    spec: Mapping[str, Any]
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    passing: bool = False
    task: asyncio.Task[bool] | None = None


@dataclass
class Container:
    spec: Mapping[str, Any]
    process: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restart_count: int = 0
    last_terminated: dict[str, Any] | None = None
    terminated: dict[str, Any] | None = None  # final: the policy does not restart it
    waiting: tuple[str, str] = ("ContainerCreating", "")
    next_start: float = 0.0
    backoff: float = BACKOFF_INITIAL_SECONDS
    readiness: Probe | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_offset: int = 0  # where this run's output starts in its log (the termination message's)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def ready(self) -> bool:
        return self.running and (self.readiness is None or self.readiness.passing)


def _terminated_state(returncode: int, started_at: str) -> dict[str, Any]:
    exit_code = 128 - returncode if returncode < 0 else returncode  # killed by signal N -> 128+N
    return {
        "exitCode": exit_code,
        "reason": "Completed" if exit_code == 0 else "Error",
        "startedAt": started_at,
        "finishedAt": now_rfc3339(),
    }


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class PodRuntime:
    def __init__(
        self,
        api: KubeApi,
        pod: Mapping[str, Any],
        node_index: int,
        host_ip: str,
        network: podnet.PodNetwork,
        state_dir: Path,
    ) -> None:
        self.api = api
        self.pod = pod
        self.node_index = node_index
        self.host_ip = host_ip
        self.network = network
        meta = pod["metadata"]
        self.uid = str(meta["uid"])
        self.namespace, self.name = str(meta["namespace"]), str(meta["name"])
        self.dir = state_dir / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.restart_policy = pod["spec"].get("restartPolicy", "Always")
        self.containers = [Container(spec) for spec in pod["spec"]["containers"]]
        self.init_containers = [Container(spec) for spec in pod["spec"].get("initContainers") or []]
        self.sandbox: podnet.PodSandbox | None = None
        self.start_time = now_rfc3339()
        self.config_error = ""
        self._config_retry_at = 0.0
        self.stopping = False
        self._transitions: dict[str, tuple[str, str]] = {}
        self._last_status: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        spec = self.pod["spec"]
        hostname = spec.get("hostname") or self.name
        subdomain = spec.get("subdomain")
        self.dir.mkdir(parents=True, exist_ok=True)
        fqdn = f"{hostname}.{subdomain}.{self.namespace}.svc.{podnet.CLUSTER_DOMAIN}" if subdomain else None
        aliases = [(a["ip"], " ".join(a.get("hostnames", []))) for a in spec.get("hostAliases") or []]
        self.sandbox = self.network.create_sandbox(
            self.node_index, self.name, self.namespace, hostname, fqdn, aliases
        )
        for container in self.containers:
            if container.spec.get("readinessProbe"):
                container.readiness = Probe(container.spec["readinessProbe"])
        await self._configure_and_spawn()

    async def _configure_and_spawn(self) -> None:
        """Resolves every container's environment, then starts them all (none if one cannot start:
        a missing ConfigMap, say, is retried until it appears, as the kubelet does)."""
        assert self.sandbox is not None
        status_for_env = {**self.pod, "status": {"podIP": self.sandbox.address, "hostIP": self.host_ip}}
        service_env = api_service_env(self.network.gateway, podnet.API_PORT)
        self.config_error = ""
        try:
            await pod_mounts.write_volumes(self.api, self.pod, self.dir)
            await pod_mounts.link_claim_volumes(self.api, self.pod, self.dir)
        except ContainerConfigError as error:
            self.config_error = str(error)
            for container in [*self.init_containers, *self.containers]:
                container.waiting = ("ContainerCreating", str(error))  # the kubelet's volume wait
        for container in [*self.init_containers, *self.containers] if not self.config_error else []:
            try:
                container.env = await container_env(self.api, status_for_env, container.spec, service_env)
                container_argv(container.spec, container.env)
            except ContainerConfigError as error:
                container.waiting = ("CreateContainerConfigError", str(error))
                self.config_error = str(error)
        if self.config_error:
            self._config_retry_at = time.monotonic() + CONFIG_RETRY_SECONDS
        elif (first := pod_init.current(self.init_containers)) is not None:
            self._spawn(self.init_containers[first])  # init containers first, one at a time
        else:
            for container in self.containers:
                self._spawn(container)

    def _spawn(self, container: Container) -> None:
        assert self.sandbox is not None
        argv = container_argv(container.spec, container.env)
        mounts = pod_mounts.container_mounts(self.pod, container.spec, self.dir)
        cwd = pod_mounts.working_dir(container.spec, self.dir, mounts)
        Path(cwd).mkdir(parents=True, exist_ok=True)
        pod_mounts.ensure_mount_points(mounts)
        script = pod_mounts.mount_prologue(
            mounts, pod_mounts.read_only_root(container.spec), pod_mounts.image_paths()
        )
        sandbox_exec = [podnet.IP, "netns", "exec", self.sandbox.netns]
        sandbox_exec += ["unshare", "--uts", "--mount", "--propagation", "private", "--"]
        log = open(self.dir / f"{container.name}.log", "ab")  # noqa: SIM115 (the child holds it)
        container.log_offset = log.seek(0, os.SEEK_END)
        with log:
            container.process = subprocess.Popen(
                [*sandbox_exec, "sh", "-c", script + _SET_HOSTNAME_AND_EXEC, self.sandbox.hostname, *argv],
                env=container.env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        container.started_at = now_rfc3339()
        container.waiting = ("", "")
        if container.readiness is not None:
            container.readiness.passing = False
            container.readiness.successes = container.readiness.failures = 0
            delay = container.readiness.spec.get("initialDelaySeconds", 0)
            container.readiness.next_at = time.monotonic() + delay

    async def stop(self, grace_seconds: float) -> None:
        """As the kubelet: each running container's preStop hook, then SIGTERM to its main process
        (not its children), all within the grace; SIGKILL to whatever is left after it."""
        self.stopping = True
        deadline = time.monotonic() + grace_seconds
        await asyncio.gather(*(self._pre_stop(c, deadline) for c in self.containers if c.running))
        for container in [*self.init_containers, *self.containers]:
            if container.running:
                assert container.process is not None
                with contextlib.suppress(ProcessLookupError):
                    container.process.send_signal(signal.SIGTERM)
        while time.monotonic() < deadline and any(
            c.running for c in [*self.init_containers, *self.containers]
        ):
            await asyncio.sleep(0.1)
        for container in [*self.init_containers, *self.containers]:
            if container.process is not None:
                _signal_group(container.process.pid, signal.SIGKILL)
                if container.running:
                    await asyncio.to_thread(container.process.wait)
        if self.sandbox is not None:
            self.network.remove_sandbox(self.sandbox)  # also kills processes that left the group
            self.sandbox = None

    async def _pre_stop(self, container: Container, deadline: float) -> None:
        hook = ((container.spec.get("lifecycle") or {}).get("preStop") or {}).get("exec")
        if hook is not None:
            await self._exec_in_sandbox(hook["command"], container, max(deadline - time.monotonic(), 0.0))

    async def _exec_in_sandbox(self, command: list[str], container: Container, timeout: float) -> bool:
        """Runs `command` in the pod's network namespace; True when it exits 0 within `timeout`."""
        assert self.sandbox is not None
        process = await asyncio.create_subprocess_exec(
            podnet.IP, "netns", "exec", self.sandbox.netns, *command,
            env=container.env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            return await asyncio.wait_for(process.wait(), timeout) == 0
        except TimeoutError:
            _signal_group(process.pid, signal.SIGKILL)
            await process.wait()
            return False

    # --- the sync loop ------------------------------------------------------------------------

    async def tick(self) -> None:
        """Reaps exited containers, restarts them as the policy says, schedules readiness probes."""
        now = time.monotonic()
        if self.config_error and self.sandbox is not None and now >= self._config_retry_at:
            await self._configure_and_spawn()
        if self.stopping or self.config_error or not self._tick_init(now):
            return
        for container in self.containers:
            process = container.process
            if process is not None and (returncode := process.poll()) is not None:
                self._on_exit(container, returncode, now)
            if container.process is None and container.terminated is None and now >= container.next_start:
                if container.last_terminated is not None:
                    container.restart_count += 1
                self._spawn(container)
            if container.running and container.readiness is not None:
                self._maybe_probe(container.readiness, container, now)

    def _tick_init(self, now: float) -> bool:
        """Runs the init containers in order (`e2e.pod_init`); True once all completed."""
        index = pod_init.current(self.init_containers)
        if index is None:
            return True
        if pod_init.init_failed(self.init_containers):
            return False
        container = self.init_containers[index]
        process = container.process
        if process is not None and (returncode := process.poll()) is not None:
            self._on_exit(container, returncode, now, init=True)
        if container.process is None and container.terminated is None and now >= container.next_start:
            if container.last_terminated is not None:
                container.restart_count += 1
            self._spawn(container)
        return pod_init.current(self.init_containers) is None

    def _on_exit(self, container: Container, returncode: int, now: float, init: bool = False) -> None:
        state = _terminated_state(returncode, container.started_at)
        message = pod_init.termination_message(
            container.spec, self.dir / f"{container.name}.log", container.log_offset, state["exitCode"]
        )
        if message:
            state["message"] = message
        assert container.process is not None
        # As a runtime ends a container with its main process: whatever it started goes too (a
        # restarted container would otherwise meet its predecessor's children on its ports).
        _signal_group(container.process.pid, signal.SIGKILL)
        container.process = None
        restart = self.restart_policy == "Always" or (
            self.restart_policy == "OnFailure" and state["exitCode"] != 0
        )
        if init:  # an init container that completed is done; one that failed retries unless Never
            restart = self.restart_policy != "Never" and state["exitCode"] != 0
        if restart:
            container.last_terminated = state
            container.waiting = (
                "CrashLoopBackOff",
                f"back-off {container.backoff:.0f}s restarting failed container",
            )
            container.next_start = now + container.backoff
            container.backoff = min(container.backoff * 2, BACKOFF_MAX_SECONDS)
        else:
            container.terminated = state

    def _maybe_probe(self, probe: Probe, container: Container, now: float) -> None:
        if probe.task is not None and probe.task.done():
            ok = probe.task.result()
            probe.task = None
            probe.successes, probe.failures = (probe.successes + 1, 0) if ok else (0, probe.failures + 1)
            if probe.successes >= probe.spec.get("successThreshold", 1):
                probe.passing = True
            if probe.failures >= probe.spec.get("failureThreshold", 3):
                probe.passing = False
        if probe.task is None and now >= probe.next_at:
            probe.next_at = now + probe.spec.get("periodSeconds", 10)
            probe.task = asyncio.get_running_loop().create_task(self._run_probe(probe.spec, container))

    async def _run_probe(self, spec: Mapping[str, Any], container: Container) -> bool:
        assert self.sandbox is not None
        timeout = float(spec.get("timeoutSeconds", 1))
        try:
            if "httpGet" in spec:
                get = spec["httpGet"]
                url = f"http://{get.get('host') or self.sandbox.address}:{self._port(get['port'], container)}"
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
                # From the node's own address, as a kubelet probes (pods see their node, not the bridge).
                transport = httpx.AsyncHTTPTransport(local_address=self.host_ip)
                async with httpx.AsyncClient(transport=transport, timeout=timeout, trust_env=False) as client:
                    response = await client.get(url + get.get("path", "/"), headers=headers)
                return 200 <= response.status_code < 400
            if "tcpSocket" in spec:
                port = self._port(spec["tcpSocket"]["port"], container)
                _reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.sandbox.address, port), timeout
                )
                writer.close()
                return True
            if "exec" in spec:
                return await self._exec_in_sandbox(spec["exec"]["command"], container, timeout)
        except (httpx.HTTPError, OSError, TimeoutError):
            return False
        return False

    def _port(self, port: int | str, container: Container) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        return int(next(p["containerPort"] for p in container.spec.get("ports", []) if p.get("name") == port))

    # --- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        statuses = [self._container_status(c) for c in self.containers]
        initialized = pod_init.initialized(self.init_containers)
        if not initialized:
            for status_ in statuses:
                status_["state"] = {"waiting": {"reason": "PodInitializing"}}
        if pod_init.init_failed(self.init_containers):
            phase = "Failed"
        elif (
            self.config_error
            or not initialized
            or not all(c.process or c.terminated or c.last_terminated for c in self.containers)
        ):
            phase = "Pending"
        elif all(c.terminated is not None for c in self.containers):
            failed = any(c.terminated and c.terminated["exitCode"] != 0 for c in self.containers)
            phase = "Failed" if failed else "Succeeded"
        else:
            phase = "Running"
        all_ready = all(c.ready for c in self.containers)
        not_ready = "PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady"
        conditions = [
            self._condition("Initialized", initialized, "ContainersNotInitialized"),
            self._condition("Ready", all_ready, not_ready),
            self._condition("ContainersReady", all_ready, not_ready),
            self._condition("PodScheduled", True),
        ]
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": conditions,
            "hostIP": self.host_ip,
            "startTime": self.start_time,
            "containerStatuses": statuses,
            **(
                {"initContainerStatuses": [self._container_status(c) for c in self.init_containers]}
                if self.init_containers
                else {}
            ),
            "qosClass": "BestEffort",
        }
        if self.sandbox is not None:
            status["podIP"] = self.sandbox.address
            status["podIPs"] = [{"ip": self.sandbox.address}]
        return status

    def _condition(self, kind: str, true: bool, reason_if_false: str = "") -> dict[str, Any]:
        value = "True" if true else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != value:
            self._transitions[kind] = (value, now_rfc3339())
        condition = {"type": kind, "status": value, "lastProbeTime": None}
        condition["lastTransitionTime"] = self._transitions[kind][1]
        if reason_if_false and not true:
            condition["reason"] = reason_if_false
        return condition

    def _container_status(self, container: Container) -> dict[str, Any]:
        if container.terminated is not None:
            state: dict[str, Any] = {"terminated": container.terminated}
        elif container.process is not None:
            state = {"running": {"startedAt": container.started_at}}
        else:
            reason, message = container.waiting
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        status = {
            "name": container.name,
            "state": state,
            "lastState": {"terminated": container.last_terminated} if container.last_terminated else {},
            "ready": container.ready,
            "restartCount": container.restart_count,
            "image": container.spec.get("image", ""),
            "imageID": "",
            "started": container.running,
        }
        if container.process is not None:
            status["containerID"] = f"tessera://{container.process.pid}"
        return status

    async def report(self) -> None:
        """Writes the status when it changed (a pod deleted meanwhile is not an error)."""
        status = self.status()
        if status == self._last_status:
            return
        try:
            await self.api.merge_patch(f"{self.path}/status", {"status": status})
            self._last_status = status
        except httpx.HTTPStatusError as error:
            if error.response.status_code not in (404, 409):
                raise
