"""Validating admission webhook: cross-field rules, each error naming its field.

The schema already rejects wrong types and ranges; this adds what structural schemas cannot
say in Kubernetes 1.20 (no CEL). The rules themselves live in `validation.py`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import kopf

from tessera_operator import api
from tessera_operator.certs import self_signed
from tessera_operator.config import OperatorConfig
from tessera_operator.validation import validate_object

HANDLER_ID = "tessera-validate"  # also the URL path the API server calls
_registered = False


async def validate_inference_cluster(spec: Any, name: str | None, **_: Any) -> None:
    errors = validate_object(name or "generated", dict(spec))
    if errors:
        raise kopf.AdmissionError("; ".join(str(e) for e in errors), code=422)


def register() -> None:
    """Register the handler; only when a server is configured (kopf refuses handlers without one)."""
    global _registered
    if not _registered:
        kopf.on.validate(api.GROUP, api.VERSION, api.PLURAL, id=HANDLER_ID)(validate_inference_cluster)  # type: ignore[arg-type]
        _registered = True


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Serve the webhook when a port is configured (otherwise the reconciler still refuses bad specs)."""
    if config.webhook_port is None:
        return
    host = config.webhook_host or config.webhook_addr
    # A mounted TLS Secret (tls.crt/tls.key) wins; otherwise a self-signed pair (dev mode).
    directory = Path(config.webhook_cert_dir or tempfile.mkdtemp(prefix="tessera-webhook-"))
    certfile, pkeyfile = directory / "tls.crt", directory / "tls.key"
    if not certfile.exists():
        certfile, pkeyfile = self_signed(directory, host)
    settings.admission.server = kopf.WebhookServer(
        addr=config.webhook_addr,
        port=config.webhook_port,
        host=host,
        certfile=certfile,
        pkeyfile=pkeyfile,
        cafile=certfile,
    )
    if config.webhook_managed:
        settings.admission.managed = config.webhook_managed
