"""Self-signed certificates and keys for the local control plane, made with the openssl CLI.

openssl is on every Debian machine, so the test cluster needs no extra Python dependency.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e import podnet

# The apiserver is reached on loopback by the host, by pods at their bridge's gateway (the node
# agent forwards it: `KUBERNETES_SERVICE_HOST`), and in-cluster clients would use these names.
SERVER_SANS = (
    "IP:127.0.0.1",
    "IP:10.96.0.1",
    *(f"IP:{address}" for address in podnet.every_gateway_address()),
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)
# The name in the client certificate the API server presents to admission webhooks (through its
# AdmissionConfiguration's kubeConfig): the operator's webhook takes reviews from this name only.
WEBHOOK_CLIENT_NAME = "kube-apiserver-webhook-client"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@dataclass(frozen=True)
class Pki:
    """Paths of the CA, the apiserver serving pair and the service-account signing pair."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.directory / "apiserver.crt"

    @property
    def server_key(self) -> Path:
        return self.directory / "apiserver.key"

    @property
    def webhook_client_cert(self) -> Path:
        return self.directory / "apiserver-webhook-client.crt"

    @property
    def webhook_client_key(self) -> Path:
        return self.directory / "apiserver-webhook-client.key"

    @property
    def sa_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.directory / "sa.pub"

    @classmethod
    def create(cls, directory: Path) -> Pki:
        directory.mkdir(parents=True, exist_ok=True)
        pki = cls(directory)
        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        _openssl(
            "req", "-x509", *ec, "-days", "3650", "-subj", "/CN=tessera-local-ca",
            "-keyout", pki.ca_key.name, "-out", pki.ca_cert.name, cwd=directory,
        )  # fmt: skip
        pki.issue("apiserver", "/CN=kube-apiserver", usage="serverAuth", sans=SERVER_SANS)
        pki.issue("apiserver-webhook-client", f"/CN={WEBHOOK_CLIENT_NAME}", usage="clientAuth")
        _openssl(
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            "sa.key",
            cwd=directory,
        )
        _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)
        return pki

    def issue(self, name: str, subject: str, usage: str, sans: Sequence[str] = ()) -> tuple[Path, Path]:
        """Signs a new key pair `<name>.crt`/`<name>.key` with the CA; returns (cert, key)."""
        ext = self.directory / f"{name}.ext"
        lines = [f"extendedKeyUsage={usage}", "keyUsage=critical,digitalSignature,keyEncipherment"]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        _openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", subject, "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=self.directory,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", self.ca_cert.name, "-CAkey", self.ca_key.name,
            "-CAcreateserial", "-days", "3650", "-extfile", ext.name, "-out", f"{name}.crt",
            cwd=self.directory,
        )  # fmt: skip
        return self.directory / f"{name}.crt", self.directory / f"{name}.key"


def client_subject(user: str, groups: Sequence[str] = ()) -> str:
    """An X.509 subject the apiserver reads as user (CN) and groups (O)."""
    for part in (user, *groups):
        if "/" in part or "=" in part:
            raise ValueError(f"unsupported character in certificate subject part {part!r}")
    return "/CN=" + user + "".join(f"/O={g}" for g in groups)
