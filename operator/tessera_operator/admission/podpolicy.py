"""What an InferenceCluster may put into the pods the operator creates on its author's behalf.

The operator holds `pods/create` wherever it serves, and whoever writes an InferenceCluster
borrows that right. By default a spec cannot reach node files (hostPath, or any volume type
outside the Pod Security Standards' restricted list), Secrets (env `secretKeyRef`, secret
volumes, a CSI driver's secret), API credentials (a ServiceAccount of its choice, projected
tokens), a PriorityClass that preempts other work, or annotations that lift the container's
confinement; the operator's configuration opens the first four one by one. The Secret
allow-list covers `imagePullSecrets` too (the kubelet pulls with them on the pods' behalf). Nor
may a spec place rank pods on control-plane nodes (a nodeSelector or node-affinity term on
their role labels, a toleration of their NoSchedule taints) unless `allow_control_plane`. No
spec may ask for more than `max_pods_per_cluster` pods.
"""

from __future__ import annotations

from typing import Any

from tessera_operator.api import InferenceClusterSpec
from tessera_operator.config import PodPolicy
from tessera_operator.fielderror import FieldError

# Pod annotations that loosen the container's AppArmor or (legacy) seccomp confinement.
CONFINEMENT_ANNOTATIONS = (
    "container.apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
)


# Volume types a spec may always use: the Pod Security Standards' "restricted" profile (none
# reaches the node or a remote server on the node's behalf: no nfs, iscsi, gitRepo, flexVolume,
# ...), less `secret`, which the policy gates like hostPath.
VOLUME_TYPES = frozenset(
    {"emptyDir", "configMap", "downwardAPI", "projected", "persistentVolumeClaim", "ephemeral", "csi"}
)
PROJECTED_SOURCES = frozenset({"configMap", "downwardAPI", "secret", "serviceAccountToken"})
# The role labels of control-plane nodes, which kubeadm also taints NoSchedule with these keys.
CONTROL_PLANE_KEYS = frozenset({"node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master"})
CONTROL_PLANE_FLAG = "--allow-control-plane"


SECRET_FLAGS = "--allowed-secrets NAME or --allow-secrets"


def _secret_name(reference: object, key: str) -> object:
    """The Secret a reference names (None when it names none: refused unless all are allowed)."""
    return reference.get(key) if isinstance(reference, dict) else None


def _not_allowed(what: str, flag: str) -> str:
    return f"{what} is not allowed by the operator's configuration ({flag})"


def check_pod_count(spec: InferenceClusterSpec, policy: PodPolicy) -> list[FieldError]:
    """Pods at the peak: the most groups the spec or its autoscaler asks for, plus surge groups."""
    group = spec.pods_per_group
    cap = policy.max_pods_per_cluster
    autoscaled = spec.autoscaling.max_replicas if spec.autoscaling and spec.autoscaling.enabled else 0
    surge = spec.rollout.max_surge
    for field, groups in (
        ("spec.replicas", spec.replicas),
        ("spec.autoscaling.maxReplicas", autoscaled),
        ("spec.rollout.maxSurge", max(spec.replicas, autoscaled) + surge),
    ):
        if groups * group > cap:
            return [
                FieldError(
                    field,
                    f"{groups} groups x {group} pods per group (tensor x pipeline / template.ranksPerPod) = "
                    f"{groups * group} pods, "
                    f"more than the operator's cap of {cap} pods per cluster (--max-pods-per-cluster)",
                )
            ]
    return []


def _volume_errors(
    index: int, volume: dict[str, Any], policy: PodPolicy, token_allowed: bool
) -> list[FieldError]:
    field = f"spec.template.volumes[{index}]"
    errors = []
    for kind in sorted(volume.keys() - {"name"}):
        if kind not in VOLUME_TYPES | {"hostPath", "secret"}:
            errors.append(
                FieldError(
                    f"{field}.{kind}",
                    f"a {kind} volume is not allowed: rank pods take {', '.join(sorted(VOLUME_TYPES))} "
                    "volumes (and secret or hostPath where the operator's configuration allows them)",
                )
            )
    if "hostPath" in volume and not policy.allow_host_path:
        errors.append(FieldError(f"{field}.hostPath", _not_allowed("a hostPath volume", "--allow-host-path")))
    if "secret" in volume and not policy.secret_allowed(_secret_name(volume["secret"], "secretName")):
        errors.append(FieldError(f"{field}.secret", _not_allowed("a secret volume", SECRET_FLAGS)))
    csi = volume["csi"] if isinstance(volume.get("csi"), dict) else {}
    if "nodePublishSecretRef" in csi and not policy.secret_allowed(
        _secret_name(csi["nodePublishSecretRef"], "name")
    ):
        errors.append(
            FieldError(
                f"{field}.csi.nodePublishSecretRef",
                _not_allowed("a Secret handed to a CSI driver", SECRET_FLAGS),
            )
        )
    projected = volume.get("projected")
    sources = (projected.get("sources") if isinstance(projected, dict) else None) or []
    for j, source in enumerate(sources if isinstance(sources, list) else []):
        where = f"{field}.projected.sources[{j}]"
        if not isinstance(source, dict):
            errors.append(FieldError(where, "must be an object"))
            continue
        for kind in sorted(source.keys() - PROJECTED_SOURCES):
            errors.append(FieldError(f"{where}.{kind}", f"a projected {kind} source is not allowed"))
        if "secret" in source and not policy.secret_allowed(_secret_name(source["secret"], "name")):
            errors.append(FieldError(f"{where}.secret", _not_allowed("a projected Secret", SECRET_FLAGS)))
        if "serviceAccountToken" in source and not token_allowed:
            errors.append(
                FieldError(
                    f"{where}.serviceAccountToken",
                    "rank pods get no API credentials unless spec.template.serviceAccountName names an "
                    "allowed ServiceAccount (--allowed-service-accounts)",
                )
            )
    return errors


def _selects_control_plane(expressions: Any) -> list[int]:
    """Indexes of node-selector requirements that pick control-plane nodes (In, Exists on a role
    label; NotIn and DoesNotExist keep pods away from them and pass)."""
    return [
        j
        for j, e in enumerate(expressions if isinstance(expressions, list) else [])
        if isinstance(e, dict)
        and e.get("key") in CONTROL_PLANE_KEYS
        and e.get("operator") in ("In", "Exists")
    ]


def _control_plane_errors(template: Any) -> list[FieldError]:
    field = "spec.template"
    placed = f"would place rank pods on control-plane nodes ({CONTROL_PLANE_FLAG})"
    errors = [
        FieldError(f"{field}.nodeSelector[{key}]", f"a control-plane node label {placed}")
        for key in template.node_selector
        if key in CONTROL_PLANE_KEYS
    ]
    node = (template.affinity or {}).get("nodeAffinity")
    node = node if isinstance(node, dict) else {}
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    base = f"{field}.affinity.nodeAffinity"
    for i, term in enumerate(terms if isinstance(terms, list) else []):
        term = term if isinstance(term, dict) else {}
        for j in _selects_control_plane(term.get("matchExpressions")):
            where = f"{base}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{i}].matchExpressions[{j}]"
            errors.append(FieldError(where, f"a control-plane node term {placed}"))
    preferred = node.get("preferredDuringSchedulingIgnoredDuringExecution")
    for i, weighted in enumerate(preferred if isinstance(preferred, list) else []):
        preference = weighted.get("preference") if isinstance(weighted, dict) else None
        expressions = preference.get("matchExpressions") if isinstance(preference, dict) else None
        for j in _selects_control_plane(expressions):
            where = f"{base}.preferredDuringSchedulingIgnoredDuringExecution[{i}].preference.matchExpressions[{j}]"
            errors.append(FieldError(where, f"a control-plane node term {placed}"))
    for i, toleration in enumerate(template.tolerations):
        key, operator = toleration.get("key"), toleration.get("operator")
        if toleration.get("effect") not in (None, "", "NoSchedule"):
            continue  # the control-plane taints are NoSchedule
        every_taint = not key and operator == "Exists"
        if key in CONTROL_PLANE_KEYS or every_taint:
            what = "a toleration of every taint" if every_taint else "a toleration of the control-plane taint"
            errors.append(FieldError(f"{field}.tolerations[{i}]", f"{what} {placed}"))
    return errors


def check_pod_policy(spec: InferenceClusterSpec, policy: PodPolicy) -> list[FieldError]:
    template = spec.template
    errors = check_pod_count(spec, policy)
    for i, secret in enumerate(template.image_pull_secrets):
        if not policy.secret_allowed(secret):
            errors.append(
                FieldError(
                    f"spec.template.imagePullSecrets[{i}]",
                    _not_allowed(f"pulling the image with Secret {secret!r}", SECRET_FLAGS),
                )
            )
    if not policy.allow_control_plane:
        errors += _control_plane_errors(template)
    for path, kind, name, allowed, flag in (
        ("serviceAccountName", "ServiceAccount", template.service_account_name,
         policy.allowed_service_accounts, "--allowed-service-accounts"),
        ("priorityClassName", "PriorityClass", template.priority_class_name,
         policy.allowed_priority_classes, "--allowed-priority-classes"),
    ):  # fmt: skip
        if name is not None and name not in allowed:
            errors.append(FieldError(f"spec.template.{path}", _not_allowed(f"{kind} {name!r}", flag)))
    for i, var in enumerate(template.env):
        reference = (var.value_from or {}).get("secretKeyRef")
        if reference is not None and not policy.secret_allowed(_secret_name(reference, "name")):
            errors.append(
                FieldError(
                    f"spec.template.env[{i}].valueFrom.secretKeyRef",
                    _not_allowed("an environment variable from this Secret", SECRET_FLAGS),
                )
            )
    account = template.service_account_name
    token_allowed = account is not None and account in policy.allowed_service_accounts
    for i, volume in enumerate(template.volumes):
        errors += _volume_errors(i, volume, policy, token_allowed)
    for key in template.annotations:
        if key.startswith(CONFINEMENT_ANNOTATIONS):
            errors.append(
                FieldError(
                    f"spec.template.annotations[{key}]",
                    "annotations that change AppArmor or seccomp confinement are not allowed",
                )
            )
    return errors
