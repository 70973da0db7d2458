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
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX_ANNOTATIONS_BYTES = 256 * 1024  # the API server's limit on all annotations of one object
RESOURCE_KINDS = ("requests", "limits")


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a label key / resource name (`[prefix/]name`), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return f"{key!r}: the prefix must be a DNS subdomain of at most 253 characters"
    if len(name) > 63 or not _NAME.match(name):
        return (
            f"{key!r}: the name must be 1-63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"
        )
    return None


def label_value_problem(value: str) -> str | None:
    if value and (len(value) > 63 or not _NAME.match(value)):
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


def check_resources(field: str, resources: Mapping[str, Any] | None) -> list[FieldError]:
    """`{requests: {name: quantity}, limits: {...}}`: known keys, valid names, finite quantities, requests <= limits."""
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
            problem = qualified_name_problem(str(name))
            if problem:
                errors.append(FieldError(where, problem))
                continue
            try:
                parsed.setdefault(kind, {})[name] = parse_quantity(amount)
            except ValueError as exc:
                errors.append(FieldError(where, str(exc)))
    for name, request in parsed.get("requests", {}).items():
        limit = parsed.get("limits", {}).get(name)
        if limit is not None and request > limit:
            errors.append(FieldError(f"{field}.requests[{name}]", f"must be <= {field}.limits[{name}]"))
    return errors
