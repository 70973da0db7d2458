"""Kubernetes' own syntax rules for what the spec copies into every pod, checked at admission.

Without them a bad label value or quantity passes the CRD schema (free-form there) and then
fails every pod create with a 422; here it is rejected up front, naming the field at fault.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from tessera_operator.fielderror import FieldError
from tessera_operator.quantity import parse_quantity

_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX_ANNOTATIONS_BYTES = 256 * 1024  # the API server's limit on all annotations of one object
RESOURCE_KINDS = ("requests", "limits")


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a label key / resource name (`[prefix/]name`), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return f"{key!r}: the prefix must be a DNS subdomain of at most 253 characters"
    if len(name) > 63 or not _NAME.fullmatch(name):
        return (
            f"{key!r}: the name must be 1-63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"
        )
    return None


def label_value_problem(value: str) -> str | None:
    if value and (len(value) > 63 or not _NAME.fullmatch(value)):
        return f"{value!r}: a label value is at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"
    return None


def check_labels(field: str, labels: Mapping[str, str]) -> list[FieldError]:
    errors = []
    for key, value in labels.items():
        problem = qualified_name_problem(key) or label_value_problem(value)
        if problem:
            errors.append(FieldError(f"{field}[{key}]", problem))
    return errors


def check_annotations(field: str, annotations: Mapping[str, str]) -> list[FieldError]:
    errors = [
        FieldError(f"{field}[{key}]", problem)
        for key in annotations
        if (problem := qualified_name_problem(key)) is not None
    ]
    size = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
    if size > MAX_ANNOTATIONS_BYTES:
        errors.append(FieldError(field, f"{size} bytes in total, at most {MAX_ANNOTATIONS_BYTES}"))
    return errors


STANDARD_CONTAINER_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage"})


def is_extended_resource(name: str) -> bool:
    """A name with a domain outside kubernetes.io (nvidia.com/gpu): integers, never overcommitted."""
    return "/" in name and "kubernetes.io/" not in name and not name.startswith("requests.")


def resource_name_problem(name: str) -> str | None:
    """Why `name` cannot be a container's resource (the API server's validateContainerResourceName)."""
    problem = qualified_name_problem(name)
    if problem:
        return problem
    if "/" not in name and name not in STANDARD_CONTAINER_RESOURCES and not name.startswith("hugepages-"):
        return (
            f"{name!r}: a container resource without a domain must be cpu, memory, ephemeral-storage "
            "or hugepages-<size>; others are qualified (nvidia.com/gpu)"
        )
    if name.startswith("requests."):
        return f"{name!r}: the 'requests.' prefix is for quotas, not containers"
    return None


def check_resources(field: str, resources: Mapping[str, Any] | None) -> list[FieldError]:
    """`{requests: {name: quantity}, limits: {...}}`: known keys, container resource names, finite
    quantities, requests <= limits; extended resources whole and requested exactly at their limit."""
    errors: list[FieldError] = []
    parsed: dict[str, dict[str, Decimal]] = {}
    for kind, amounts in (resources or {}).items():
        if kind not in RESOURCE_KINDS:
            errors.append(
                FieldError(f"{field}.{kind}", f"unknown key (expected one of {', '.join(RESOURCE_KINDS)})")
            )
            continue
        if not isinstance(amounts, Mapping):
            errors.append(FieldError(f"{field}.{kind}", "must map resource names to quantities"))
            continue
        for name, amount in amounts.items():
            where = f"{field}.{kind}[{name}]"
            problem = resource_name_problem(str(name))
            if problem:
                errors.append(FieldError(where, problem))
                continue
            try:
                quantity = parse_quantity(amount)
            except ValueError as exc:
                errors.append(FieldError(where, str(exc)))
                continue
            if is_extended_resource(name) and quantity != quantity.to_integral_value():
                errors.append(FieldError(where, f"{amount!r}: an extended resource must be a whole number"))
                continue
            parsed.setdefault(kind, {})[name] = quantity
    limits = parsed.get("limits", {})
    for name, request in parsed.get("requests", {}).items():
        where = f"{field}.requests[{name}]"
        exact = is_extended_resource(name) or name.startswith("hugepages-")  # never overcommitted
        if exact and name not in limits:
            errors.append(FieldError(where, f"needs {field}.limits[{name}] (it cannot be overcommitted)"))
        elif exact and request != limits[name]:
            errors.append(
                FieldError(where, f"must equal {field}.limits[{name}] (it cannot be overcommitted)")
            )
        elif name in limits and request > limits[name]:
            errors.append(FieldError(where, f"must be <= {field}.limits[{name}]"))
    return errors


ENV_SOURCES = frozenset({"fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef", "fileKeyRef"})
TOLERATION_OPERATORS = ("", "Exists", "Equal")
TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
AFFINITY_KINDS = ("nodeAffinity", "podAffinity", "podAntiAffinity")


def check_env_source(field: str, value: str | None, source: Mapping[str, Any] | None) -> list[FieldError]:
    """A variable has a literal value or one source (the API server's rule), never both."""
    if source is None:
        return []
    if value:
        return [FieldError(f"{field}.valueFrom", "may not be given with a non-empty value")]
    sources = [key for key in source if key in ENV_SOURCES]
    if len(sources) != 1 or len(source) != 1:
        return [
            FieldError(f"{field}.valueFrom", f"must hold exactly one of {', '.join(sorted(ENV_SOURCES))}")
        ]
    return []


def check_volume(field: str, volume: Mapping[str, Any]) -> list[FieldError]:
    """A name (a DNS label) and exactly one volume type."""
    name = volume.get("name")
    if not isinstance(name, str) or not _DNS1123_LABEL.fullmatch(name):
        return [FieldError(f"{field}.name", "must be a DNS label: 1-63 lowercase alphanumerics or '-'")]
    types = [key for key in volume if key != "name"]
    if len(types) != 1:
        what = "no volume type" if not types else f"{len(types)} volume types ({', '.join(types)})"
        return [FieldError(field, f"must have exactly one volume type, got {what}")]
    if not isinstance(volume[types[0]], Mapping):
        return [FieldError(f"{field}.{types[0]}", "must be an object")]
    return []


def check_volume_mount(field: str, mount: Mapping[str, Any]) -> list[FieldError]:
    path = mount.get("mountPath")
    if not isinstance(path, str) or not path:
        return [FieldError(f"{field}.mountPath", "is required")]
    return []


def check_toleration(field: str, toleration: Mapping[str, Any]) -> list[FieldError]:
    """The API server's ValidateTolerations: a label key, a label value (Equal) or none (Exists),
    a known effect, and tolerationSeconds only for NoExecute."""
    errors = []
    key, operator = toleration.get("key") or "", toleration.get("operator", "")
    value, effect = toleration.get("value") or "", toleration.get("effect", "")
    problem = qualified_name_problem(str(key)) if key else None
    if problem:
        errors.append(FieldError(f"{field}.key", problem))
    if operator not in TOLERATION_OPERATORS:
        errors.append(FieldError(f"{field}.operator", "must be Exists or Equal"))
    elif operator == "Exists" and value:
        errors.append(FieldError(f"{field}.value", "must be empty when operator is Exists"))
    elif operator != "Exists" and (problem := label_value_problem(str(value))):
        errors.append(FieldError(f"{field}.value", problem))
    if effect not in TAINT_EFFECTS:
        errors.append(FieldError(f"{field}.effect", "must be NoSchedule, PreferNoSchedule or NoExecute"))
    elif toleration.get("tolerationSeconds") is not None and effect != "NoExecute":
        errors.append(FieldError(f"{field}.effect", "must be NoExecute when tolerationSeconds is set"))
    if not key and operator != "Exists":
        errors.append(FieldError(f"{field}.operator", "must be Exists when key is empty"))
    return errors


def check_affinity(field: str, affinity: Mapping[str, Any] | None) -> list[FieldError]:
    """Only the three kinds, each an object (the operator adds its own podAffinity term to it)."""
    errors = []
    for key, value in (affinity or {}).items():
        if key not in AFFINITY_KINDS:
            errors.append(
                FieldError(f"{field}.{key}", f"unknown key (expected one of {', '.join(AFFINITY_KINDS)})")
            )
        elif not isinstance(value, Mapping):
            errors.append(FieldError(f"{field}.{key}", "must be an object"))
    return errors
