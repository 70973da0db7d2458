"""Every rule an InferenceCluster must pass before the operator acts on it.

The CRD schema holds types and ranges; this adds what structural schemas cannot say in
Kubernetes 1.20 (no CEL): cross-field rules, Kubernetes' syntax for what is copied into pods
(so a bad value never turns into a 422 on every pod create), and the operator's pod policy.
Used by the validating webhook (reject at admission) and by the reconciler (refuse to act,
report `Degraded/InvalidSpec`) so an object that slipped past a missing webhook is still safe.
Every error names the field at fault.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from tessera_operator import builders, naming
from tessera_operator.admission.k8sformat import (
    check_affinity,
    check_annotations,
    check_env_source,
    check_labels,
    check_resources,
    check_toleration,
    check_volume,
    check_volume_mount,
    is_extended_resource,
    qualified_name_problem,
    resource_name_problem,
)
from tessera_operator.admission.known_models import known_model
from tessera_operator.admission.podpolicy import PodPolicy, check_pod_policy
from tessera_operator.api import InferenceClusterSpec, TemplateSpec
from tessera_operator.builders import RESERVED_ENV
from tessera_operator.fielderror import FieldError
from tessera_operator.naming import CLUSTER_NAME_RE, MAX_CLUSTER_NAME
from tessera_operator.quantity import quantity_to_bytes

__all__ = ["RESERVED_ENV", "FieldError", "PodPolicy", "validate_object"]

log = logging.getLogger("tessera_operator.admission.validation")


def parse_spec(raw: dict[str, Any]) -> tuple[InferenceClusterSpec | None, list[FieldError]]:
    try:
        return InferenceClusterSpec.model_validate(raw), []
    except ValidationError as exc:
        return None, [FieldError(field_path(err["loc"]), err["msg"]) for err in exc.errors()]


def field_path(loc: tuple[int | str, ...]) -> str:
    """pydantic's location as kubectl spells a field: spec.template.env[0].name."""
    return "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)


# Suffixes that make one cluster's derived object name another's of the same kind: IC `a-ranks`'s
# client Service (`<name>`) is IC `a`'s headless Service (`<name>-ranks`). The operator's other
# derived names cannot meet (naming.py): pods end in `-g<i>-s<j>-t<k>`, read from the right; the
# group Secret `<name>-group-secret` and the NetworkPolicies `<name>-ranks`, `<name>-clients` are
# each the only objects of their kind named from a cluster, all with a suffix.
DERIVED_SUFFIXES = (naming.headless_service_name(""),)


def validate_name(name: str) -> list[FieldError]:
    if len(name) > MAX_CLUSTER_NAME or not CLUSTER_NAME_RE.fullmatch(name):
        return [
            FieldError(
                "metadata.name",
                f"must be a DNS-1035 label of at most {MAX_CLUSTER_NAME} characters "
                f"(rank pod hostnames are derived from it), got {name!r}",
            )
        ]
    for suffix in DERIVED_SUFFIXES:
        if name.endswith(suffix):
            return [
                FieldError(
                    "metadata.name",
                    f"{name!r} ends in {suffix!r}, which the operator appends to a cluster's name for "
                    f"the objects it owns (cluster {name[: -len(suffix)]!r} would own an object named "
                    f"{name!r} too)",
                )
            ]
    return []


def validate_layout(spec: InferenceClusterSpec) -> list[FieldError]:
    errors: list[FieldError] = []
    par = spec.parallelism
    if par.sequence_parallel and par.tensor < 2:
        errors.append(FieldError("spec.parallelism.sequenceParallel", "needs spec.parallelism.tensor > 1"))
    per_pod = spec.template.ranks_per_pod
    if per_pod not in (1, par.tensor):
        errors.append(
            FieldError(
                "spec.template.ranksPerPod",
                f"must be 1 (a pod per rank) or spec.parallelism.tensor ({par.tensor}: a pod per pipeline "
                f"stage holding its whole tensor-parallel group), got {per_pod}",
            )
        )
    model = known_model(spec.model.source)
    layers = model.num_layers if model is not None else None
    problem = model.tensor_split_problem(par.tensor, par.expert_parallel) if model is not None else None
    if par.expert_parallel and model is not None and "EP" not in model.parallelism:
        errors.append(
            FieldError(
                "spec.parallelism.expertParallel",
                f"the model has no experts (model {spec.model.source!r} is a dense {model.family} model)",
            )
        )
    if problem:
        errors.append(FieldError("spec.parallelism.tensor", f"{problem} (model {spec.model.source!r})"))
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
    return errors


def validate_policies(spec: InferenceClusterSpec) -> list[FieldError]:
    errors: list[FieldError] = []
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
    autoscaled = spec.autoscaling is not None and spec.autoscaling.enabled
    if autoscaled and spec.engine.metrics_prefix == "vllm":
        errors.append(
            FieldError(
                "spec.engine.metricsPrefix",
                "vllm hides tessera:num_requests_waiting, which spec.autoscaling reads: use both",
            )
        )
    if spec.router.inference_pool and spec.router.endpoint_picker is None:
        errors.append(
            FieldError(
                "spec.router.endpointPicker",
                "is needed with inferencePool: an InferencePool (v1) names its Endpoint Picker",
            )
        )
    if spec.autoscaling is not None and spec.autoscaling.min_replicas == 0 and not spec.router.enabled:
        errors.append(
            FieldError(
                "spec.autoscaling.minReplicas",
                "0 needs spec.router.enabled: the router holds the requests that arrive at zero groups "
                "and counts them, which is what scales the cluster up again",
            )
        )
    return errors


def validate_engine(spec: InferenceClusterSpec) -> list[FieldError]:
    errors: list[FieldError] = []
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
    if eng.kv_cache_memory is not None:
        try:
            if quantity_to_bytes(eng.kv_cache_memory) < 1:  # the engine takes whole bytes, at least one
                errors.append(FieldError("spec.engine.kvCacheMemory", "must be at least 1 byte"))
        except ValueError as exc:
            errors.append(FieldError("spec.engine.kvCacheMemory", str(exc)))
    return errors or validate_context(spec)


def validate_context(spec: InferenceClusterSpec) -> list[FieldError]:
    """For a known model, what every rank would refuse once loaded: a context longer than the
    model's, or a KV cache too small for one sequence of it (checked with a lower bound of the
    busiest rank's bytes per token, so a spec the runtime takes is never refused)."""
    model = known_model(spec.model.source)
    if model is None:
        return []
    max_len = spec.model.max_model_len
    if max_len is not None and max_len > model.max_context:
        return [
            FieldError(
                "spec.model.maxModelLen",
                f"{max_len} is longer than the context of model {spec.model.source!r} "
                f"({model.max_context} tokens)",
            )
        ]
    if spec.engine.kv_cache_memory is None:
        return []
    par, block = spec.parallelism, spec.engine.block_size
    element_size = 4 if spec.model.dtype == "float32" else 2
    per_block = block * model.min_kv_bytes_per_token(par.tensor, par.pipeline, element_size)
    blocks = quantity_to_bytes(spec.engine.kv_cache_memory) // per_block
    needed = -(-(max_len or model.max_context) // block)
    if blocks >= needed:
        return []
    length = "spec.model.maxModelLen" if max_len is not None else "the model's context"
    return [
        FieldError(
            "spec.engine.kvCacheMemory",
            f"{spec.engine.kv_cache_memory} holds at most {blocks} blocks of {block} tokens per rank, "
            f"fewer than one sequence of {length} ({max_len or model.max_context} tokens, {needed} "
            "blocks) needs: raise it or lower spec.model.maxModelLen",
        )
    ]


def _reserved_keys(field: str, keys: Any, what: str) -> list[FieldError]:
    return [
        FieldError(f"{field}[{key}]", f"{what} {key!r} is set by the operator")
        for key in keys
        if key in naming.RESERVED_LABELS or key.startswith(naming.RESERVED_PREFIX)
    ]


def validate_volumes(template: TemplateSpec) -> list[FieldError]:
    errors: list[FieldError] = []
    names: set[str] = set()
    for i, volume in enumerate(template.volumes):
        name = volume.get("name")
        errors += check_volume(f"spec.template.volumes[{i}]", volume)
        if not isinstance(name, str):
            continue  # check_volume said so
        if name in naming.OPERATOR_VOLUMES:
            errors.append(
                FieldError(f"spec.template.volumes[{i}].name", f"{name!r} is a volume of the operator")
            )
        elif name in names:
            errors.append(FieldError(f"spec.template.volumes[{i}].name", f"duplicate volume {name!r}"))
        names.add(name)
    for i, mount in enumerate(template.volume_mounts):
        errors += check_volume_mount(f"spec.template.volumeMounts[{i}]", mount)
        if not isinstance(mount.get("name"), str) or mount["name"] not in names:
            errors.append(
                FieldError(
                    f"spec.template.volumeMounts[{i}].name",
                    f"{mount.get('name')!r} is not in spec.template.volumes",
                )
            )
    return errors


def validate_template(template: TemplateSpec) -> list[FieldError]:
    """What is copied into every pod, in Kubernetes' own syntax (otherwise every pod create fails)."""
    field = "spec.template"
    errors = check_resources(f"{field}.resources", template.resources)
    errors += check_labels(f"{field}.labels", template.labels)
    errors += _reserved_keys(f"{field}.labels", template.labels, "label")
    errors += check_annotations(f"{field}.annotations", template.annotations)
    errors += _reserved_keys(f"{field}.annotations", template.annotations, "annotation")
    errors += check_labels(f"{field}.nodeSelector", template.node_selector)
    name = template.gpu_resource_name
    problem = resource_name_problem(name)
    if not problem and not is_extended_resource(name):
        problem = f"{name!r}: an accelerator is an extended resource with a domain (nvidia.com/gpu)"
    if problem:
        errors.append(FieldError(f"{field}.gpuResourceName", problem))
    for i, var in enumerate(template.env):
        if var.name in RESERVED_ENV:
            errors.append(FieldError(f"{field}.env[{i}].name", f"{var.name} is set by the operator"))
        errors += check_env_source(f"{field}.env[{i}]", var.value, var.value_from)
    for i, toleration in enumerate(template.tolerations):
        errors += check_toleration(f"{field}.tolerations[{i}]", toleration)
    errors += check_affinity(f"{field}.affinity", template.affinity)
    return errors + validate_volumes(template)


# -- spec.scheduling ----------------------------------------------------------------------------


def validate_scheduling(spec: InferenceClusterSpec, policy: PodPolicy) -> list[FieldError]:
    """One scheduler's settings, and only its own; no pod key the operator writes for it set by hand."""
    scheduling, field = spec.scheduling, "spec.scheduling"
    chosen = scheduling.scheduler
    errors = [
        FieldError(f"{field}.{other}", f"is set, but {field}.scheduler is {chosen}")
        for other in ("volcano", "kueue")
        if other != chosen and getattr(scheduling, other) is not None
    ]
    if chosen == "kueue" and scheduling.kueue is None:
        errors.append(
            FieldError(f"{field}.kueue.queueName", "is needed with scheduler kueue (its LocalQueue)")
        )
    volcano = scheduling.volcano
    if chosen == "volcano" and volcano is not None:
        if volcano.scheduler_name == "default-scheduler":
            errors.append(
                FieldError(
                    f"{field}.volcano.schedulerName",
                    "names the default scheduler, which ignores PodGroups: the groups would not be gangs",
                )
            )
        name = volcano.priority_class_name
        if name is not None and name not in policy.allowed_priority_classes:
            errors.append(
                FieldError(
                    f"{field}.volcano.priorityClassName",
                    f"PriorityClass {name!r} is not allowed by the operator (--allowed-priority-classes)",
                )
            )
    if chosen == "default":
        return errors
    template = spec.template
    for what, keys, written in (
        ("labels", template.labels, builders.GANG_LABELS),
        ("annotations", template.annotations, builders.GANG_ANNOTATIONS),
    ):
        errors += [
            FieldError(
                f"spec.template.{what}[{key}]", f"is set by the operator with {field}.scheduler {chosen}"
            )
            for key in keys
            if key in written
        ]
    return errors


def validate_spec(spec: InferenceClusterSpec, policy: PodPolicy | None = None) -> list[FieldError]:
    policy = policy or PodPolicy()
    errors = validate_layout(spec) + validate_policies(spec) + validate_engine(spec)
    errors += validate_template(spec.template) + validate_scheduling(spec, policy)
    problem = qualified_name_problem(spec.placement.topology_key)
    if problem:
        errors.append(FieldError("spec.placement.topologyKey", problem))
    return errors + check_pod_policy(spec, policy)


def validate_object(name: str, raw_spec: dict[str, Any], policy: PodPolicy | None = None) -> list[FieldError]:
    """All errors of one object; `policy` is the operator's (default: the strictest)."""
    spec, errors = parse_spec(raw_spec)
    errors = validate_name(name) + errors
    if spec is not None:
        try:
            errors += validate_spec(spec, policy)
        except Exception as exc:  # a free-form value of a shape no rule foresaw: refused, not a crash
            log.exception("cannot check the spec of %s", name)
            errors.append(FieldError("spec", f"cannot be checked: {type(exc).__name__}: {exc}"))
    return errors


# Faults a write through the scale subresource can cause (`kubectl scale`, an HPA): admission
# never sees those writes, so they are not refused but held at the cap.
COUNT_FIELDS = frozenset({"spec.replicas", "spec.rollout.maxSurge"})


def capped_spec(
    raw_spec: dict[str, Any], errors: list[FieldError], policy: PodPolicy
) -> InferenceClusterSpec | None:
    """The spec at the most groups the operator's pod cap allows, when too many replicas are its
    only fault: the cluster keeps its groups running and repaired meanwhile. None otherwise."""
    if not errors or any(e.field not in COUNT_FIELDS for e in errors):
        return None
    spec = InferenceClusterSpec.model_validate(raw_spec)
    group = spec.pods_per_group
    allowed = max(policy.max_pods_per_cluster // group - spec.rollout.max_surge, 0)
    capped = spec.model_copy(update={"replicas": min(spec.replicas, allowed)})
    return None if validate_spec(capped, policy) else capped
