"""A container's process as the kubelet would start it: its environment and its argv.

The image stands for the locally installed Tessera: a container command `tessera ...` runs the
checkout's virtual environment's `tessera`, and that environment's bin/ comes first on PATH.
"""

from __future__ import annotations

import base64
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from e2e.kube_api import KubeApi
from tessera_operator.quantity import parse_quantity

VENV_BIN = Path(sys.executable).parent
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Settings of the machine that a pod needs to find this checkout's code and caches.
PASSED_THROUGH = (
    "PYTHONPATH",
    "OMP_NUM_THREADS",
    "TESSERA_CACHE",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "LANG",
)
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_LABEL_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


class ContainerConfigError(ValueError):
    """What the kubelet reports as CreateContainerConfigError (a missing ConfigMap key, ...)."""


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names are replaced, `$$` escapes, unknown stay as is."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(replace, value)


def field_value(pod: Mapping[str, Any], path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIP": status.get("podIP", ""),
        "status.podIPs": status.get("podIP", ""),
    }
    if path in simple:
        return str(simple[path])
    match = _LABEL_FIELD.fullmatch(path)
    if match:
        return str(meta.get(match.group(1), {}).get(match.group(2), ""))
    raise ContainerConfigError(f"unsupported fieldRef {path!r}")


def resource_field_value(pod: Mapping[str, Any], container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    """The downward API's resourceFieldRef as the kubelet resolves it: the container's request or
    limit over the divisor, rounded up; an unset limit is the node's capacity (this host's)."""
    name = ref.get("containerName") or container["name"]
    target = next((c for c in pod["spec"]["containers"] if c["name"] == name), None)
    kind, _, resource = str(ref.get("resource", "")).partition(".")
    if target is None or kind not in ("limits", "requests") or resource not in ("cpu", "memory"):
        raise ContainerConfigError(f"unsupported resourceFieldRef {dict(ref)!r}")
    resources = target.get("resources") or {}
    amount = (resources.get(kind) or {}).get(resource)
    if amount is None and kind == "requests":
        amount = (resources.get("limits") or {}).get(resource, 0)  # requests default to limits
    if amount is None:  # the node's allocatable: this host's
        host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        amount = (os.cpu_count() or 1) if resource == "cpu" else host_memory
    value, divisor = parse_quantity(amount), parse_quantity(ref.get("divisor") or "1")
    if divisor == 0:
        raise ContainerConfigError(f"resourceFieldRef divisor 0 for {resource}")
    return str(math.ceil(value / divisor))


async def _object_data(api: KubeApi, kind: str, namespace: str, name: str) -> dict[str, str] | None:
    item = await api.get_or_none(f"/api/v1/namespaces/{namespace}/{kind}s/{name}")
    if item is None:
        return None
    if kind == "secret":
        return {k: base64.b64decode(v).decode() for k, v in (item.get("data") or {}).items()}
    return dict(item.get("data") or {})


async def _key_ref(api: KubeApi, kind: str, namespace: str, ref: Mapping[str, Any]) -> str | None:
    data = await _object_data(api, kind, namespace, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ContainerConfigError(f"{kind} {ref['name']!r} or its key {ref['key']!r} not found")
    return data[ref["key"]]


def api_service_env(host: str, port: int) -> dict[str, str]:
    """The variables the kubelet gives every container for the `kubernetes` Service (whatever
    enableServiceLinks says): in-cluster clients find the API server through them."""
    url = f"tcp://{host}:{port}"
    prefix = f"KUBERNETES_PORT_{port}_TCP"
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": url,
        prefix: url,
        f"{prefix}_PROTO": "tcp",
        f"{prefix}_PORT": str(port),
        f"{prefix}_ADDR": host,
    }


async def container_env(
    api: KubeApi,
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    service_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The container's environment: the machine's pass-throughs, then `service_env` (the
    kubelet's Service variables), then envFrom, then env (each later one wins, and $(VAR) sees
    the earlier ones)."""
    namespace = pod["metadata"]["namespace"]
    env = {name: os.environ[name] for name in PASSED_THROUGH if name in os.environ}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{SYSTEM_PATH}",
        HOME=os.environ.get("HOME", "/root"),
        HOSTNAME=pod["spec"].get("hostname") or pod["metadata"]["name"],
    )
    env.update(service_env or {})
    for source in container.get("envFrom") or []:
        for kind in ("configMap", "secret"):
            ref = source.get(f"{kind}Ref")
            if ref is None:
                continue
            data = await _object_data(api, kind.lower(), namespace, ref["name"])
            if data is None and not ref.get("optional"):
                raise ContainerConfigError(f"{kind} {ref['name']!r} not found")
            env.update({source.get("prefix", "") + k: v for k, v in (data or {}).items()})
    for item in container.get("env") or []:
        value: str | None
        source = item.get("valueFrom")
        if source is None:
            value = expand(item.get("value", ""), env)
        elif "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            value = resource_field_value(pod, container, source["resourceFieldRef"])
        elif "configMapKeyRef" in source:
            value = await _key_ref(api, "configmap", namespace, source["configMapKeyRef"])
        elif "secretKeyRef" in source:
            value = await _key_ref(api, "secret", namespace, source["secretKeyRef"])
        else:
            raise ContainerConfigError(f"unsupported valueFrom for {item['name']!r}: {sorted(source)}")
        if value is not None:
            env[item["name"]] = value
    return env


def container_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    argv = [expand(word, env) for word in [*(container.get("command") or []), *(container.get("args") or [])]]
    if not argv:
        raise ContainerConfigError(
            f"container {container['name']!r} has no command (images have no entrypoint here)"
        )
    if argv[0] == "tessera":
        argv[0] = str(VENV_BIN / "tessera")
    return argv
