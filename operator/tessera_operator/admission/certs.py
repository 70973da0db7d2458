"""A self-signed serving certificate for the admission webhook (development and tests).

kopf's own generator needs `certbuilder`/`oscrypto`, which fail to load against OpenSSL 3;
the `openssl` command line does the same job. In production the chart mounts a real
certificate (e.g. from cert-manager) instead.
"""

from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path

SELF_SIGNED_DAYS = 365


def self_signed(directory: Path, host: str, extra: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Write (cert.pem, key.pem) valid for `host` (and `extra` names); the cert is its own CA."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    sans = []
    for name in (host, "localhost", "127.0.0.1", *extra):
        try:
            ipaddress.ip_address(name)
            sans.append(f"IP:{name}")
        except ValueError:
            sans.append(f"DNS:{name}")
    command = [
        "openssl", "req", "-x509", "-nodes", "-days", str(SELF_SIGNED_DAYS),
        "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-subj", "/CN=tessera-webhook",  # a CN holds 64 characters; the names live in the SANs
        "-addext", "subjectAltName=" + ",".join(dict.fromkeys(sans)),
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-keyout", str(key), "-out", str(cert),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return cert, key
