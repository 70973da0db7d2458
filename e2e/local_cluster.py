"""A genuine Kubernetes control plane on loopback: etcd + kube-apiserver + kube-controller-manager.

The binaries come from `e2e/install_k8s.sh` (cached outside the work tree). There is no kubelet and
no scheduler: one fake Ready `Node` is registered so pods can be bound to it by name, and tests play
the kubelet by writing `pods/status`. Run `python -m e2e.local_cluster up` for a cluster by hand.
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

from e2e.pki import Pki, client_subject

INSTALL_SCRIPT = Path(__file__).with_name("install_k8s.sh")
BINARIES = ("kube-apiserver", "kube-controller-manager", "etcd", "kubectl", "helm")
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: the control plane never outlives a killed test run.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


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
    ) -> None:
        self.bin_dir = Path(bin_dir) if bin_dir else default_bin_dir()
        self.users = tuple(users)
        self.node_name = node_name
        self.admin_token = secrets.token_hex(16)
        self._tokens = {user: secrets.token_hex(16) for user in self.users}
        self._kcm_token = secrets.token_hex(16)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.workdir = Path(tempfile.mkdtemp(prefix="tessera-k8s-"))
        self.port = free_port()
        self.api_url = f"https://127.0.0.1:{self.port}"
        self.etcd_url = f"http://127.0.0.1:{free_port()}"
        self.kubeconfig = str(self.workdir / "admin.kubeconfig")
        self.ca_file = str(self.workdir / "pki" / "ca.crt")
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
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for name in reversed(list(self._procs)):  # controller-manager, apiserver, then etcd
            proc = self._procs.pop(name)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
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
        capacity = dict(capacity or {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "0"})
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"},
            },
        }
        self.api("POST", "/api/v1/nodes", node)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "tessera local node (no kubelet: tests write pod status)",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
            }
        }
        self.api(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            status,
            content_type="application/strategic-merge-patch+json",
        )

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

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (lives as long as the process)
        with log:
            self._procs[name] = subprocess.Popen(
                [str(self.bin_dir / name), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop them in order
                preexec_fn=_die_with_parent,
            )

    def _start_etcd(self) -> None:
        peer = free_port()
        self._spawn(
            "etcd",
            [
                "--name=tessera",
                f"--data-dir={self._etcd_dir()}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=tessera=http://127.0.0.1:{peer}",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self) -> None:
        assert self._pki is not None
        pki = self._pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                "--insecure-port=0",
                f"--tls-cert-file={pki.server_cert}",
                f"--tls-private-key-file={pki.server_key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--api-audiences=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
        )

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

    def _write_tokens(self) -> None:
        rows = [
            f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"',
            f"{self._kcm_token},system:kube-controller-manager,system:kube-controller-manager",
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

    def _default_sa_ready(self) -> bool:
        return self.service_account_ready("default")

    def service_account_ready(self, namespace: str, name: str = "default") -> bool:
        """True once the ServiceAccount exists with a token secret (1.20 pods need one to be admitted)."""
        try:
            sa = self.api("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return False
            raise
        return bool(sa.get("secrets"))


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.local_cluster", description=__doc__)
    parser.add_argument("command", choices=["up"], help="start a cluster in the foreground; Ctrl-C stops it")
    parser.parse_args(argv)
    if not binaries_installed():
        install_binaries()
    started = time.monotonic()
    with LocalCluster() as cluster:
        print(f"cluster ready in {time.monotonic() - started:.1f}s at {cluster.api_url}", flush=True)
        print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        print(f"export PATH={cluster.bin_dir}:$PATH", flush=True)
        print("Ctrl-C stops the cluster.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
