"""Cross-field rules the CRD schema cannot express (Kubernetes 1.20 has no CEL).

Used by the validating webhook (reject at admission) and by the reconciler (refuse to act,
report `Degraded/InvalidSpec`) so an object that slipped past a missing webhook is still safe.
Every error names the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tessera.topology import Topology
from tessera_operator.api import InferenceClusterSpec
from tessera_operator.known_models import known_num_layers
from tessera_operator.naming import CLUSTER_NAME_RE, MAX_CLUSTER_NAME

# Variables the operator owns in every rank pod; the user's env must not shadow them.
RESERVED_ENV = frozenset(Topology.model_validate({}).to_env()) | {"TESSERA_LAYER_PARTITION", "PYTHONHASHSEED"}


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def parse_spec(raw: dict[str, Any]) -> tuple[InferenceClusterSpec | None, list[FieldError]]:
    try:
        return InferenceClusterSpec.model_validate(raw), []
    except ValidationError as exc:
        errors = [
            FieldError("spec." + ".".join(str(p) for p in err["loc"]), err["msg"]) for err in exc.errors()
        ]
        return None, errors


def validate_name(name: str) -> list[FieldError]:
    if len(name) > MAX_CLUSTER_NAME or not CLUSTER_NAME_RE.match(name):
        return [
            FieldError(
                "metadata.name",
                f"must be a DNS-1035 label of at most {MAX_CLUSTER_NAME} characters "
                f"(rank pod hostnames are derived from it), got {name!r}",
            )
        ]
    return []


def validate_spec(spec: InferenceClusterSpec) -> list[FieldError]:
    errors: list[FieldError] = []
    par = spec.parallelism
    if par.sequence_parallel and par.tensor < 2:
        errors.append(FieldError("spec.parallelism.sequenceParallel", "needs spec.parallelism.tensor > 1"))
    layers = known_num_layers(spec.model.source)
    if par.layer_partition is not None:
        if len(par.layer_partition) != par.pipeline:
            errors.append(
                FieldError(
                    "spec.parallelism.layerPartition",
                    f"has {len(par.layer_partition)} entries, spec.parallelism.pipeline is {par.pipeline}",
                )
            )
        elif layers is not None and sum(par.layer_partition) != layers:
            errors.append(
                FieldError(
                    "spec.parallelism.layerPartition",
                    f"sums to {sum(par.layer_partition)}, model {spec.model.source!r} has {layers} layers",
                )
            )
    elif layers is not None and par.pipeline > layers:
        errors.append(
            FieldError("spec.parallelism.pipeline", f"{par.pipeline} stages for a model of {layers} layers")
        )
    if spec.rollout.max_unavailable == 0 and spec.rollout.max_surge == 0:
        errors.append(
            FieldError(
                "spec.rollout.maxUnavailable", "maxUnavailable and maxSurge cannot both be 0 (no progress)"
            )
        )
    rp = spec.restart_policy
    if rp.backoff_base_seconds > rp.backoff_max_seconds:
        errors.append(
            FieldError(
                "spec.restartPolicy.backoffBaseSeconds", "must be <= spec.restartPolicy.backoffMaxSeconds"
            )
        )
    if spec.autoscaling is not None and spec.autoscaling.min_replicas > spec.autoscaling.max_replicas:
        errors.append(FieldError("spec.autoscaling.minReplicas", "must be <= spec.autoscaling.maxReplicas"))
    eng = spec.engine
    if (
        not eng.enable_chunked_prefill
        and spec.model.max_model_len is not None
        and eng.max_num_batched_tokens < spec.model.max_model_len
    ):
        errors.append(
            FieldError(
                "spec.engine.maxNumBatchedTokens",
                "must be >= spec.model.maxModelLen when chunked prefill is off",
            )
        )
    for i, var in enumerate(spec.template.env):
        if var.name in RESERVED_ENV:
            errors.append(FieldError(f"spec.template.env[{i}].name", f"{var.name} is set by the operator"))
    return errors


def validate_object(name: str, raw_spec: dict[str, Any]) -> list[FieldError]:
    spec, errors = parse_spec(raw_spec)
    errors = validate_name(name) + errors
    if spec is not None:
        errors += validate_spec(spec)
    return errors
