"""A genuine Kubernetes control plane on loopback: etcd + kube-apiserver + kube-controller-manager.

The binaries come from `e2e/install_k8s.sh` (cached outside the work tree). By default there is no
kubelet and no scheduler: one fake Ready `Node` is registered so pods can be bound to it by name,
and tests play the kubelet by writing `pods/status`. With `nodes=[...]` the cluster is complete:
kube-scheduler places pods and the project's node agent (`e2e.node_agent`) runs them, each pod in
a network namespace of its own; `expose()` gives a Service one stable URL on 127.0.0.1.

    python -m e2e.local_cluster up [--nodes 3] [--operator] [--expose NS/SERVICE:PORT=LOCALPORT]   # background
    python -m e2e.local_cluster down
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from e2e import podnet
from e2e.chart_operator import start_chart_operator
from e2e.node_objects import node_object, node_ready_status
from e2e.pki import WEBHOOK_CLIENT_NAME, Pki, client_subject
from tessera.ports import free_port

INSTALL_SCRIPT = Path(__file__).with_name("install_k8s.sh")
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd", "kubectl", "helm")
ADMIN_USER = "tessera-admin"
# Static-token users with no groups: they can do nothing until RBAC binds them.
DEFAULT_USERS = ("tessera-operator", "tessera-tenant")
DEFAULT_NODE = "tessera-node-0"
# Controllers that need a cloud, real nodes or a CSR signer are left out.
CONTROLLERS = "*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-route,-service,-attachdetach,-csrsigning"


def k8s_version() -> str:
    """The Debian `kubernetes` package version the install script builds (single source of truth)."""
    match = re.search(r'^K8S_DEB_VERSION="([^"]+)"', INSTALL_SCRIPT.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"K8S_DEB_VERSION not found in {INSTALL_SCRIPT}")
    return match.group(1)


def default_bin_dir() -> Path:
    cache = os.environ.get("TESSERA_CACHE") or str(Path.home() / ".cache" / "tessera")
    return Path(cache) / "k8s" / k8s_version() / "bin"


def binaries_installed(bin_dir: Path | None = None) -> bool:
    bin_dir = bin_dir or default_bin_dir()
    return all(os.access(bin_dir / name, os.X_OK) for name in BINARIES)


def install_binaries() -> None:
    """Runs the (idempotent) install script; a cold build takes several minutes."""
    subprocess.run(["bash", str(INSTALL_SCRIPT)], check=True)


def _signal_on_parent_death(sig: signal.Signals) -> None:
    # PR_SET_PDEATHSIG: the control plane never outlives a killed test run.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)


def _die_with_parent() -> None:
    _signal_on_parent_death(signal.SIGKILL)


def _term_with_parent() -> None:
    _signal_on_parent_death(signal.SIGTERM)


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {self.stderr}"


class LocalCluster:
    """Starts on `start()` (or `with LocalCluster() as cluster:`); `stop()` removes everything."""

    def __init__(
        self,
        bin_dir: Path | str | None = None,
        users: Sequence[str] = DEFAULT_USERS,
        node_name: str | None = DEFAULT_NODE,
        nodes: Sequence[str] = (),
    ) -> None:
        self.bin_dir = Path(bin_dir) if bin_dir else default_bin_dir()
        self.users = tuple(users)
        self.node_name = node_name
        self.agent_nodes = tuple(nodes)
        self.agent_id = secrets.token_hex(3)
        self.admin_token = secrets.token_hex(16)
        self._tokens = {user: secrets.token_hex(16) for user in self.users}
        self._kcm_token = secrets.token_hex(16)
        self._scheduler_token = secrets.token_hex(16)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.workdir = Path(tempfile.mkdtemp(prefix="tessera-k8s-"))
        self.port = free_port()
        self.api_url = f"https://127.0.0.1:{self.port}"
        self.etcd_url = f"https://127.0.0.1:{free_port()}"
        self.kubeconfig = str(self.workdir / "admin.kubeconfig")
        self.ca_file = str(self.workdir / "pki" / "ca.crt")
        # The API server presents a client certificate of this CA and name to admission webhooks.
        self.webhook_client_ca, self.webhook_client_name = self.ca_file, WEBHOOK_CLIENT_NAME
        self._pki: Pki | None = None
        self._ssl = ssl.create_default_context()

    # --- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> LocalCluster:
        missing = [b for b in BINARIES if not os.access(self.bin_dir / b, os.X_OK)]
        if missing:
            self.stop()
            raise FileNotFoundError(f"missing {missing} in {self.bin_dir}: run `bash {INSTALL_SCRIPT}`")
        atexit.register(self.stop)
        try:
            self._pki = Pki.create(self.workdir / "pki")
            self._ssl = ssl.create_default_context(cafile=self.ca_file)
            self._write_tokens()
            self._write_kubeconfig(self.kubeconfig, ADMIN_USER, {"token": self.admin_token})
            deadline = time.monotonic() + timeout
            self._start_etcd()
            self._start_apiserver()
            self._wait("kube-apiserver /readyz", deadline, self._apiserver_ready)
            kcm_kubeconfig = str(self.workdir / "kcm.kubeconfig")
            self._write_kubeconfig(
                kcm_kubeconfig, "system:kube-controller-manager", {"token": self._kcm_token}
            )
            self._start_controller_manager(kcm_kubeconfig)
            self._wait("the default ServiceAccount and its token", deadline, self._default_sa_ready)
            if self.node_name:
                self.register_node(self.node_name)
            if self.agent_nodes:
                self._start_scheduler()
                self._start_node_agent()
                self._wait("the node agent's Nodes", deadline, self._agent_nodes_ready)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Proxies, the node agent (it stops its pods and removes its network), the scheduler, the
        # controller-manager, the apiserver, then etcd.
        for name in reversed(list(self._procs)):
            proc = self._procs.pop(name)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30 if name == "node-agent" else 10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.agent_nodes:
            podnet.sweep(self.agent_id)  # whatever a killed agent could not remove
        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.rmtree(self._etcd_dir(), ignore_errors=True)
        atexit.unregister(self.stop)

    # --- helpers for tests --------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """Environment for subprocesses: this cluster's admin kubeconfig, cached binaries first on PATH."""
        return {
            **os.environ,
            "KUBECONFIG": self.kubeconfig,
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, kubeconfig: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / "kubectl"), "--kubeconfig", kubeconfig or self.kubeconfig, *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self.env)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def user_kubeconfig(self, user: str, groups: Sequence[str] = ()) -> str:
        """A kubeconfig for a non-admin identity (no permissions until RBAC binds it).

        Users from `users=` authenticate with a static token; any other name (for example
        `system:serviceaccount:NS:NAME`, which RBAC ServiceAccount subjects match) or any
        `groups` get a client certificate signed by the cluster CA.
        """
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", user) + "".join(f"+{g}" for g in groups)
        path = self.workdir / f"user-{safe}.kubeconfig"
        if not path.exists():
            if user in self._tokens and not groups:
                credentials = {"token": self._tokens[user]}
            else:
                assert self._pki is not None, "cluster not started"
                cert, key = self._pki.issue(f"user-{safe}", client_subject(user, groups), usage="clientAuth")
                credentials = {"client-certificate": str(cert), "client-key": str(key)}
            self._write_kubeconfig(str(path), user, credentials)
        return str(path)

    def api(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """One admin request to the apiserver; returns the decoded JSON body."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.api_url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.admin_token}")
        request.add_header("Content-Type", content_type)
        with urllib.request.urlopen(request, context=self._ssl, timeout=30) as response:
            return json.loads(response.read() or b"null")

    def register_node(self, name: str, capacity: Mapping[str, str] | None = None) -> None:
        """A Node object with a Ready condition, so pods can be bound to it by `spec.nodeName`."""
        self.api("POST", "/api/v1/nodes", node_object(name))
        status = node_ready_status(
            "127.0.0.1", "tessera local node (no kubelet: tests write pod status)", capacity
        )
        self.api(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            status,
            content_type="application/strategic-merge-patch+json",
        )

    def expose(self, namespace: str, service: str, port: int, local_port: int | None = None) -> str:
        """Starts a proxy from 127.0.0.1 to the Service's ready endpoints; returns its base URL."""
        local_port = local_port or free_port()
        args = ["--kubeconfig", self.kubeconfig, "--namespace", namespace, "--service", service]
        args += ["--port", str(port), "--listen", str(local_port)]
        name = f"proxy-{namespace}-{service}-{port}"
        self._spawn(name, args, module="e2e.service_proxy")
        # Its own word that it listens: another program already on the port also accepts (and
        # the proxy then exits, which _wait reports).
        listening = f"127.0.0.1:{local_port} -> service"
        self._wait(
            f"the proxy on port {local_port}", time.monotonic() + 30, lambda: listening in self.logs(name)
        )
        return f"http://127.0.0.1:{local_port}"

    def process_ids(self) -> dict[str, int]:
        """The pid of every process this cluster started (control plane, agent, proxies)."""
        return {name: proc.pid for name, proc in self._procs.items()}

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """What a container of a pod run by the node agent printed (no kubelet API: no `kubectl logs`)."""
        paths = sorted((self.workdir / "pods").glob(f"{namespace}_{pod}_*/{container}.log"))
        return paths[-1].read_text(errors="replace") if paths else ""

    def pod_logs_since(self, since: float, tail: int = 40) -> str:
        """The last lines of every container log written since `since` (time.time()), pod by pod:
        what a failed test prints, so a CI log alone tells why a group never became Ready."""
        paths = [p for p in (self.workdir / "pods").glob("*/*.log") if p.stat().st_mtime >= since]
        parts = []
        for path in sorted(paths, key=lambda p: p.stat().st_mtime):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- pod {path.parent.name}, container {path.stem}\n" + "\n".join(lines))
        return "\n".join(parts)

    def log_names(self) -> list[str]:
        """The processes of this cluster that write a log: control plane, agent, proxies."""
        return sorted(path.stem for path in self.workdir.glob("*.log"))

    def logs(self, name: str, tail: int = 40) -> str:
        path = self.workdir / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-tail:])

    # --- processes ----------------------------------------------------------------------------

    def _etcd_dir(self) -> Path:
        # tmpfs makes etcd's fsyncs free; the data is thrown away anyway.
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.workdir
        return base / f"{self.workdir.name}-etcd"

    def _spawn(self, name: str, args: list[str], module: str | None = None) -> None:
        """Starts a cached binary, or with `module` a Python module of this checkout."""
        program = [sys.executable, "-m", module] if module else [str(self.bin_dir / name)]
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (lives as long as the process)
        with log:
            self._procs[name] = subprocess.Popen(
                [*program, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop them in order
                # The node agent must get the chance to remove its network namespaces.
                preexec_fn=_term_with_parent if module else _die_with_parent,
            )

    def _start_etcd(self) -> None:
        # TLS with client certificates on both ports: etcd holds every Secret (ServiceAccount
        # tokens among them), and any local user could otherwise read and write it.
        assert self._pki is not None
        cert, key = self._pki.issue("etcd", "/CN=etcd", usage="serverAuth,clientAuth", sans=["IP:127.0.0.1"])
        peer = f"https://127.0.0.1:{free_port()}"
        tls = [f"--cert-file={cert}", f"--key-file={key}", f"--trusted-ca-file={self._pki.ca_cert}"]
        tls += [f"--peer-cert-file={cert}", f"--peer-key-file={key}"]
        tls += [
            f"--peer-trusted-ca-file={self._pki.ca_cert}",
            "--client-cert-auth",
            "--peer-client-cert-auth",
        ]
        self._spawn(
            "etcd",
            [
                "--name=tessera",
                f"--data-dir={self._etcd_dir()}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=tessera={peer}",
                *tls,
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self) -> None:
        assert self._pki is not None
        pki = self._pki
        etcd_client_cert, etcd_client_key = pki.issue(
            "apiserver-etcd-client", "/CN=kube-apiserver-etcd-client", usage="clientAuth"
        )
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={self.etcd_url}",
                f"--etcd-cafile={pki.ca_cert}",
                f"--etcd-certfile={etcd_client_cert}",
                f"--etcd-keyfile={etcd_client_key}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                "--insecure-port=0",
                f"--tls-cert-file={pki.server_cert}",
                f"--tls-private-key-file={pki.server_key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                f"--admission-control-config-file={self._write_admission_config()}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--api-audiences=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16",
                # ServiceAccount admission then gives pods a projected volume (a token the node
                # agent asks the TokenRequest API for, bound to the pod; the cluster CA from the
                # kube-root-ca.crt ConfigMap; the namespace), as from Kubernetes 1.21 on.
                "--feature-gates=BoundServiceAccountTokenVolume=true",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
        )

    def _write_admission_config(self) -> Path:
        """Webhooks get the API server's client certificate (`users: [{name: "*"}]`: every webhook),
        as a platform team configures it for webhooks that authenticate their caller."""
        assert self._pki is not None
        credentials = self.workdir / "webhook-client.kubeconfig"
        user = {"client-certificate": str(self._pki.webhook_client_cert)}
        user["client-key"] = str(self._pki.webhook_client_key)
        credentials.write_text(
            yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "users": [{"name": "*", "user": user}]})
        )
        webhook = {
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "WebhookAdmissionConfiguration",
            "kubeConfigFile": str(credentials),
        }
        plugins = ("ValidatingAdmissionWebhook", "MutatingAdmissionWebhook")
        config = self.workdir / "admission.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "apiserver.config.k8s.io/v1",
                    "kind": "AdmissionConfiguration",
                    "plugins": [{"name": name, "configuration": webhook} for name in plugins],
                }
            )
        )
        return config

    def _start_controller_manager(self, kubeconfig: str) -> None:
        assert self._pki is not None
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={kubeconfig}",
                f"--service-account-private-key-file={self._pki.sa_key}",
                f"--root-ca-file={self._pki.ca_cert}",
                "--use-service-account-credentials=true",  # each controller acts as its own SA, as kubeadm does
                "--leader-elect=false",
                f"--controllers={CONTROLLERS}",
                "--port=0",
                "--secure-port=0",
                "--profiling=false",
                "--v=1",
            ],
        )

    def _start_scheduler(self) -> None:
        kubeconfig = str(self.workdir / "scheduler.kubeconfig")
        self._write_kubeconfig(kubeconfig, "system:kube-scheduler", {"token": self._scheduler_token})
        self._spawn(
            "kube-scheduler",
            [f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--port=0", "--secure-port=0", "--v=1"],
        )

    def _start_node_agent(self) -> None:
        args = ["--kubeconfig", self.kubeconfig, "--state-dir", str(self.workdir / "pods")]
        args += ["--agent-id", self.agent_id, *(f"--node={node}" for node in self.agent_nodes)]
        self._spawn("node-agent", args, module="e2e.node_agent")

    def _write_tokens(self) -> None:
        rows = [
            f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"',
            f"{self._kcm_token},system:kube-controller-manager,system:kube-controller-manager",
            f"{self._scheduler_token},system:kube-scheduler,system:kube-scheduler",
            *(f"{token},{user},{user}" for user, token in self._tokens.items()),
        ]
        path = self.workdir / "tokens.csv"
        path.write_text("\n".join(rows) + "\n")
        path.chmod(0o600)

    def _write_kubeconfig(self, path: str, user: str, credentials: Mapping[str, str]) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "tessera",
                    "cluster": {"server": self.api_url, "certificate-authority": self.ca_file},
                }
            ],
            "users": [{"name": user, "user": dict(credentials)}],
            "contexts": [
                {"name": "tessera", "context": {"cluster": "tessera", "user": user, "namespace": "default"}}
            ],
            "current-context": "tessera",
        }
        Path(path).write_text(yaml.safe_dump(config, sort_keys=False))
        Path(path).chmod(0o600)

    # --- readiness ----------------------------------------------------------------------------

    def _wait(self, what: str, deadline: float, ready: Any) -> None:
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs(name)}")
            if ready():
                return
            time.sleep(0.2)
        details = "\n".join(f"--- {name}\n{self.logs(name)}" for name in self._procs)
        raise TimeoutError(f"timed out waiting for {what}\n{details}")

    def _apiserver_ready(self) -> bool:
        try:
            request = urllib.request.Request(self.api_url + "/readyz")
            request.add_header("Authorization", f"Bearer {self.admin_token}")
            with urllib.request.urlopen(request, context=self._ssl, timeout=5) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _agent_nodes_ready(self) -> bool:
        nodes = self.api("GET", "/api/v1/nodes")["items"]
        # Ready, and schedulable: the agent has lifted the not-ready taint.
        ready = {
            n["metadata"]["name"]
            for n in nodes
            if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
            and not n["spec"].get("taints")
        }
        return ready.issuperset(self.agent_nodes)

    def _default_sa_ready(self) -> bool:
        return self.service_account_ready("default")

    def service_account_ready(self, namespace: str, name: str = "default") -> bool:
        """True once pods of the ServiceAccount are admitted and start at once: it exists, and so
        does the namespace's kube-root-ca.crt ConfigMap their token volume takes the CA from."""
        for path in (f"serviceaccounts/{name}", "configmaps/kube-root-ca.crt"):
            try:
                self.api("GET", f"/api/v1/namespaces/{namespace}/{path}")
            except urllib.error.HTTPError as error:
                if error.code == 404:
                    return False
                raise
        return True


def pointer_file() -> Path:
    """Where a background cluster records itself, so `down` finds it (removed by `down`)."""
    return default_bin_dir().parents[1] / "local-cluster.json"


def _parse_expose(text: str) -> tuple[str, str, int, int | None]:
    """NS/SERVICE:PORT[=LOCALPORT]"""
    match = re.fullmatch(r"([a-z0-9-]+)/([a-z0-9-]+):(\d+)(?:=(\d+))?", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected NS/SERVICE:PORT[=LOCALPORT], got {text!r}")
    namespace, service, port, local = match.groups()
    return namespace, service, int(port), int(local) if local else None


def _stop_on_sigterm(*_: object) -> None:
    raise KeyboardInterrupt  # unwinds whatever runs (a start half-way included), stopping it all


def _run_in_foreground(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # from `down`, even while the cluster starts
    if not binaries_installed():
        install_binaries()
    started = time.monotonic()
    nodes = [f"tessera-node-{i}" for i in range(args.nodes)]
    with (
        LocalCluster(node_name=None if nodes else DEFAULT_NODE, nodes=nodes) as cluster,
        contextlib.ExitStack() as stopping,
    ):
        if args.record:
            stopping.callback(pointer_file().unlink, missing_ok=True)
        operator = None
        if args.operator:
            operator = start_chart_operator(cluster, cluster.workdir)
            stopping.callback(operator.stop)  # before the cluster, and if a later step fails
        urls = {
            f"{ns}/{svc}:{port}": cluster.expose(ns, svc, port, local) for ns, svc, port, local in args.expose
        }
        info = {"pid": os.getpid(), "state": str(cluster.workdir), "kubeconfig": cluster.kubeconfig}
        info |= {"api": cluster.api_url, "bin": str(cluster.bin_dir), "nodes": nodes, "services": urls}
        if operator is not None:
            info["operator_log"] = str(operator.log_path)
        if args.record:
            _write_record(info)
        print(f"cluster ready in {time.monotonic() - started:.1f}s at {cluster.api_url}", flush=True)
        print(f"state folder: {cluster.workdir}", flush=True)
        print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        print(f"export PATH={cluster.bin_dir}:$PATH", flush=True)
        for service, url in urls.items():
            print(f"{service} -> {url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C, or SIGTERM from `down`
            while True:
                time.sleep(0.5)
    return 0


def _write_record(info: dict[str, Any]) -> None:
    """Replace the record whole (a reader never sees half of one)."""
    pointer = pointer_file()
    staged = pointer.with_suffix(".tmp")
    staged.write_text(json.dumps(info))
    staged.replace(pointer)


def _is_supervisor(pid: int) -> bool:
    """Whether ``pid`` is a cluster supervisor of this module (a record outlives a reboot or an
    OOM kill, and its pid may since belong to anything)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"e2e.local_cluster" in argv and b"--foreground" in argv


def _read_record() -> dict[str, Any] | None:
    """The recorded cluster, if its supervisor still runs; a stale record is removed."""
    pointer = pointer_file()
    try:
        info: dict[str, Any] = json.loads(pointer.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        info = {}
    if isinstance(info.get("pid"), int) and _is_supervisor(info["pid"]):
        return info
    print(f"removing a stale record of a cluster that is no longer running ({pointer})")
    pointer.unlink(missing_ok=True)
    return None


def recorded_cluster() -> dict[str, Any] | None:
    """The running cluster's record once it is ready (``state`` is written then), else None."""
    info = _read_record()
    return info if info is not None and "state" in info else None


def up_in_background(argv: Sequence[str]) -> int:
    if _read_record() is not None:
        print(f"a cluster is already up ({pointer_file()}); run `python -m e2e.local_cluster down` first")
        return 1
    if not binaries_installed():
        install_binaries()
    log_path = Path(tempfile.gettempdir()) / f"tessera-local-cluster-{os.getpid()}.log"
    with open(log_path, "wb") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "e2e.local_cluster", "up", "--foreground", "--record", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this command
        )
    # Recorded at once, so that `down` (or a second `up`) finds a cluster that is still starting.
    _write_record({"pid": supervisor.pid, "log": str(log_path)})
    try:
        while recorded_cluster() is None:
            if supervisor.poll() is not None:  # its log, printed below, says why
                pointer_file().unlink(missing_ok=True)
                return 1
            time.sleep(0.3)
    except KeyboardInterrupt:  # Ctrl-C while it starts: it must not come up behind the user's back
        print("interrupted: stopping the cluster that was starting")
        down()
        return 130  # as a shell reports Ctrl-C
    finally:
        print(log_path.read_text(errors="replace"), end="")
        log_path.unlink(missing_ok=True)
    print("`python -m e2e.local_cluster down` stops everything.")
    return 0


DOWN_GRACE_SECONDS = 120  # the node agent stops every pod first, each with its grace period


def down() -> int:
    info = _read_record()
    if info is None:
        print("no cluster is up")
        return 0
    pid = info["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + DOWN_GRACE_SECONDS
        while _is_supervisor(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _is_supervisor(pid):
            print(f"the cluster did not stop in {DOWN_GRACE_SECONDS} s: killing it")
            os.kill(pid, signal.SIGKILL)  # its processes follow (they die with their parent)
    pointer_file().unlink(missing_ok=True)
    print(f"stopped; state folder {info.get('state', '(not created yet)')} removed")
    return 0


def _cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m e2e.local_cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("--nodes", type=int, default=3, help="nodes run by the node agent (0: one fake node)")
    parser.add_argument(
        "--expose", type=_parse_expose, action="append", default=[], metavar="NS/SVC:PORT=LOCAL"
    )
    parser.add_argument(
        "--operator",
        action="store_true",
        help="install the CRDs and run the operator as the chart configures it",
    )
    parser.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the cluster")
    parser.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == "down":
        return down()
    if args.foreground:
        return _run_in_foreground(args)
    return up_in_background([a for a in argv if a != "up"])


if __name__ == "__main__":
    sys.exit(_cli())
