"""Pure functions: an InferenceCluster spec -> the pods and Services it should own (plain dicts).

No I/O here, so every rule about what a rank pod looks like is unit-tested without a cluster.
The topology environment is written by the runtime's own contract module (`tessera.topology`).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tessera.engine.arg_utils import engine_cli_args
from tessera.topology import (
    DEFAULT_API_PORT,
    DEFAULT_DIST_PORT,
    DEFAULT_GROUP_SECRET_FILE,
    DEFAULT_RPC_PORT,
    GROUP_SECRET_FILE_ENV,
    GROUP_SECRET_FILE_NAME,
    GROUP_SECRET_MOUNT_DIR,
    LAYOUT_ENV,
    LOCAL_RANKS_ENV,
    ParallelLayout,
    Topology,
)
from tessera_operator import model_cache, naming
from tessera_operator.api import API_VERSION, KIND, InferenceClusterSpec, VolcanoSpec
from tessera_operator.quantity import quantity_to_bytes

CONTAINER_NAME = "rank"
RUNTIME_UID = 1000
# Prefix-cache block hashes use Python's hash(): every rank of every group must agree.
PYTHONHASHSEED = "0"
HEALTH_PATH = "/health"
# `tessera serve`'s flag (entrypoints/serve_args.py; a serve flag, not an engine setting).
MAX_WAITING_FLAG = "--max-waiting-requests"
METRICS_PREFIX_FLAG = "--metrics-prefix"
# Bytes of each group's secret (the runtime needs at least 32).
GROUP_SECRET_BYTES = 32
# Only the pod's user (and fsGroup) reads it: the kubelet makes a read-only volume's files
# group-readable for the pod's fsGroup (RUNTIME_UID), so 0400 is readable by the rank.
GROUP_SECRET_MODE = 0o400
# Fields whose change alters pods (and so starts a rolling update); replicas, rollout,
# restartPolicy and autoscaling do not.
POD_AFFECTING_FIELDS = ("model", "parallelism", "engine", "template", "placement", "scheduling")
# A deleted leader keeps accepting at least this long before its SIGTERM: until then the router
# (which drops a pod marked leaving or deleted as its watch sees it) or the Service's Endpoints
# (the endpoints controller, then kube-proxy, take a moment to drop a terminating pod) may still
# send it requests, and a leader that stopped listening at once would refuse them.
LEADER_DEREGISTER_SECONDS = 5
# After its leader's drain, a worker lingers through the leader's graceful shutdown (5 s in the
# API server) computing for it.
WORKER_LINGER_SECONDS = 8
WORKER_DRAIN_SECONDS = LEADER_DEREGISTER_SECONDS + WORKER_LINGER_SECONDS  # a worker's least stay
# The pod's grace beyond rollout.drainSeconds: the leader's shutdown after its drain (a worker's
# linger fits in it too).
SHUTDOWN_SECONDS = 10
# Variables the operator owns in every rank pod; the user's env must not shadow them. The
# layout's count even where a default layout leaves them out (a layer partition, experts).
RESERVED_ENV = (
    frozenset(Topology.model_validate({}).to_env())
    | set(LAYOUT_ENV.values())
    | {LOCAL_RANKS_ENV, "PYTHONHASHSEED"}
)
# Where the runtime writes (emptyDirs; the root filesystem is read-only). The user's env or
# volumeMounts may point any of them elsewhere, e.g. TESSERA_CACHE at a persistent volume.
WRITABLE_ENV = {"TESSERA_CACHE": naming.CACHE_DIR, "TMPDIR": naming.TMP_DIR, "HOME": naming.TMP_DIR}
WRITABLE_VOLUMES: tuple[tuple[str, str, dict[str, str]], ...] = (
    # NCCL and gloo need more shared memory than the container runtime's 64 MiB default.
    (naming.SHM_VOLUME, naming.SHM_DIR, {"medium": "Memory"}),
    (naming.CACHE_VOLUME, naming.CACHE_DIR, {}),
    (naming.TMP_VOLUME, naming.TMP_DIR, {}),
)


@dataclass(frozen=True)
class ClusterRef:
    """Identity of the owning InferenceCluster."""

    name: str
    namespace: str
    uid: str


# What a revision is measured against: each pod-affecting field's default in the release that
# added it. Never edit an entry. The API server stores CRD defaults in every object it admits, so
# when a release changes a default, the old value sits in the objects. If the hash compared with
# the new default, that release would roll every cluster into identical pods. A new field's entry
# is its first default (test_builders checks that every field has one).
REVISION_BASELINE: dict[str, Any] = {
    "model": {"servedName": None, "dtype": "auto", "maxModelLen": None, "cache": None},
    "parallelism": {
        "tensor": 1,
        "pipeline": 1,
        "sequenceParallel": False,
        "layerPartition": None,
        "expertParallel": False,
    },
    "engine": {
        "maxNumSeqs": 128,
        "maxNumBatchedTokens": 2048,
        "blockSize": 16,
        "kvCacheMemory": None,
        "enablePrefixCaching": True,
        "enableChunkedPrefill": True,
        "generationConfig": "auto",
        "samplingDefaults": None,
        "maxWaitingRequests": None,
        "metricsPrefix": "tessera",
    },
    "template": {
        "image": "localhost/tessera/runtime-cpu:0.1.0",
        "imagePullPolicy": "IfNotPresent",
        "imagePullSecrets": [],
        "resources": None,
        "gpusPerRank": 0,
        "ranksPerPod": 1,
        "gpuResourceName": "nvidia.com/gpu",
        "nodeSelector": {},
        "tolerations": [],
        "affinity": None,
        "env": [],
        "volumes": [],
        "volumeMounts": [],
        "serviceAccountName": None,
        "priorityClassName": None,
        "labels": {},
        "annotations": {},
    },
    "placement": {"mode": "preferred", "topologyKey": "kubernetes.io/hostname"},
    "scheduling": {"scheduler": "default", "volcano": None, "kueue": None},
}
# Pod-affecting fields added after the first release: left out of the hash while they are at
# their baseline, so the revisions of every spec from before them stay what they were.
LATER_FIELDS = frozenset({"scheduling"})


def differences(value: Any, baseline: Any, sparse: Any = None) -> Any:
    """The parts of `value` that differ from `baseline` (objects compared key by key), or None;
    each as `sparse` (the same dump without defaults: list items' unset fields left out) has it."""
    if isinstance(value, dict) and isinstance(baseline, dict):
        sparse = sparse if isinstance(sparse, dict) else {}
        changed = {}
        for key, item in value.items():
            if key not in baseline:
                changed[key] = sparse.get(key, item)
            elif (difference := differences(item, baseline[key], sparse.get(key))) is not None:
                changed[key] = difference
        return changed or None
    if value == baseline:
        return None
    return value if sparse is None else sparse


def revision_of(spec: InferenceClusterSpec, running: Iterable[str] = ()) -> str:
    """Stable hash of the pod-affecting spec: equal specs give equal revisions across restarts.

    Only what differs from REVISION_BASELINE counts: an operator release that adds a defaulted
    field, changes a default or changes how pods are built must not roll every cluster at once.
    Its pods reach running clusters as their groups are recreated, or with the next change of
    their spec. Spellings no pod can tell apart count as one (`pod_equivalent`): an edit to one
    rolls nothing. Pods already labelled with the hash of the spec as written (as releases before
    that rule hashed it) stay current: `running` holds the running pods' revisions.
    """
    wire = spec.model_dump(by_alias=True, mode="json")
    sparse = spec.model_dump(by_alias=True, mode="json", exclude_defaults=True)
    revision = _digest(pod_equivalent(wire), sparse)
    running = set(running)
    if running and revision not in running and (as_written := _digest(wire, sparse)) in running:
        return as_written
    return revision


def _digest(wire: dict[str, Any], sparse: dict[str, Any]) -> str:
    relevant = {
        key: differences(wire[key], REVISION_BASELINE[key], sparse.get(key)) for key in pod_affecting_keys()
    }
    relevant = {k: v for k, v in relevant.items() if v is not None or k not in LATER_FIELDS}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:10]


def pod_equivalent(wire: dict[str, Any]) -> dict[str, Any]:
    """The spec as its pods tell it: a value that builds the same pods as the baseline's reads as
    the baseline's (a served name equal to the source, an empty object, a GPU resource name with
    no GPUs, placement with one pod per stage)."""
    wire = copy.deepcopy(wire)
    model, engine, template = wire["model"], wire["engine"], wire["template"]
    baseline = REVISION_BASELINE
    if model["servedName"] == model["source"]:
        model["servedName"] = None
    if engine["samplingDefaults"] is not None and not any(
        value is not None for value in engine["samplingDefaults"].values()
    ):
        engine["samplingDefaults"] = None
    for key in ("resources", "affinity"):
        if not template[key]:
            template[key] = None
    if template["gpusPerRank"] == 0:
        template["gpuResourceName"] = baseline["template"]["gpuResourceName"]
    if (
        wire["parallelism"]["tensor"] // wire["template"]["ranksPerPod"] <= 1
    ):  # no stage has pods to keep together
        wire["placement"] = dict(baseline["placement"])
    elif wire["placement"]["mode"] == "none":
        wire["placement"]["topologyKey"] = baseline["placement"]["topologyKey"]
    scheduling = wire["scheduling"]
    if scheduling["volcano"] == VolcanoSpec().model_dump(by_alias=True, mode="json"):
        scheduling["volcano"] = None  # Volcano's settings spelled out as their defaults
    return wire


def pod_affecting_keys() -> list[str]:
    return [InferenceClusterSpec.model_fields[f].alias or f for f in POD_AFFECTING_FIELDS]


def owner_reference(ref: ClusterRef) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def topology_for(
    ref: ClusterRef, spec: InferenceClusterSpec, group: int, stage: int, tp_rank: int
) -> Topology:
    par = spec.parallelism
    return Topology(
        cluster=ref.name,
        namespace=ref.namespace,
        group=group,
        layout=ParallelLayout(
            tensor_parallel_size=par.tensor,
            pipeline_parallel_size=par.pipeline,
            sequence_parallel=par.sequence_parallel,
            layer_partition=par.layer_partition,
            enable_expert_parallel=par.expert_parallel,
        ),
        tp_rank=tp_rank,
        pp_rank=stage,
        leader_addr=naming.leader_dns(ref.name, ref.namespace, group, spec.stage_pods),
        dist_port=DEFAULT_DIST_PORT,
        rpc_port=DEFAULT_RPC_PORT,
        api_port=DEFAULT_API_PORT,
    )


def engine_args(spec: InferenceClusterSpec) -> list[str]:
    """The leader's engine flags, written by the runtime's own flag definitions (vLLM's names).

    The parallel layout travels in the topology environment, not in flags; workers take every
    engine setting from their leader when they join, so they need none.
    """
    model, eng = spec.model, spec.engine
    kv_bytes = None if eng.kv_cache_memory is None else quantity_to_bytes(eng.kv_cache_memory)
    settings = engine_cli_args(
        {
            "dtype": model.dtype,
            "max_model_len": model.max_model_len,
            "max_num_seqs": eng.max_num_seqs,
            "max_num_batched_tokens": eng.max_num_batched_tokens,
            "block_size": eng.block_size,
            "kv_cache_memory": kv_bytes,
            "enable_prefix_caching": eng.enable_prefix_caching,
            "enable_chunked_prefill": eng.enable_chunked_prefill,
            # A rank given GPUs must use one: never fall back to the CPU without a word (workers
            # take the device from their leader too).
            "device": "cuda" if spec.template.gpus_per_rank > 0 else None,
            # Only when set: flags new to the pod's command would roll every group out on an upgrade.
            "generation_config": None if eng.generation_config == "auto" else eng.generation_config,
            "override_generation_config": (
                eng.sampling_defaults.model_dump(exclude_none=True) or None if eng.sampling_defaults else None
            ),
        }
    )
    return [model.source, *settings]


def container_command(spec: InferenceClusterSpec, leader: bool) -> tuple[list[str], list[str]]:
    """(command, args): the leader serves the HTTP API and runs the engine core, workers follow it."""
    if leader:
        served = spec.model.served_name or spec.model.source
        args = engine_args(spec)
        args += ["--served-model-name", served, "--host", "0.0.0.0", "--port", str(DEFAULT_API_PORT)]
        if spec.engine.max_waiting_requests is not None:  # only when set: no roll on upgrade
            args += [MAX_WAITING_FLAG, str(spec.engine.max_waiting_requests)]
        if spec.engine.metrics_prefix != "tessera":  # likewise
            args += [METRICS_PREFIX_FLAG, spec.engine.metrics_prefix]
        return ["tessera", "serve"], args
    return ["tessera", "worker"], []


def pod_security_context() -> dict[str, Any]:
    """Every pod the operator makes (rank pods, the router's): non-root, the runtime's user."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """Every container the operator makes: no privilege escalation, read-only root, no capabilities."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def resources_for(spec: InferenceClusterSpec) -> dict[str, Any]:
    resources = copy.deepcopy(spec.template.resources or {})
    gpus = spec.template.gpus_per_rank * spec.template.ranks_per_pod  # every rank of the pod its own
    if gpus > 0:
        for kind in ("requests", "limits"):
            resources.setdefault(kind, {})[spec.template.gpu_resource_name] = gpus
    return resources


def affinity_for(spec: InferenceClusterSpec, cluster: str, group: int, stage: int) -> dict[str, Any] | None:
    """The user's affinity plus a pod-affinity term that keeps one stage's TP ranks together (a pod
    holding the whole stage needs none)."""
    affinity = copy.deepcopy(spec.template.affinity or {})
    placement = spec.placement
    if placement.mode != "none" and spec.pods_per_stage > 1:
        term = {
            "labelSelector": {
                "matchLabels": {
                    naming.CLUSTER_LABEL: cluster,
                    naming.GROUP_LABEL: str(group),
                    naming.STAGE_LABEL: str(stage),
                }
            },
            "topologyKey": placement.topology_key,
        }
        pod_affinity = affinity.setdefault("podAffinity", {})
        if placement.mode == "required":
            pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
        else:
            pod_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
                {"weight": 100, "podAffinityTerm": term}
            )
    return affinity or None


def env_for(topology: Topology, spec: InferenceClusterSpec) -> list[dict[str, Any]]:
    """The contract first, then the user's variables (the webhook rejects names that clash): the
    kubelet expands `$(TESSERA_RANK)` in a value only from variables listed before it."""
    user = [var.wire() for var in spec.template.env if var.name not in RESERVED_ENV | {GROUP_SECRET_FILE_ENV}]
    user_names = {var["name"] for var in user}
    env = [{"name": k, "value": v} for k, v in topology.to_env(spec.template.ranks_per_pod).items()]
    env.append({"name": "PYTHONHASHSEED", "value": PYTHONHASHSEED})
    # The file's path, never the secret: an environment shows in `kubectl describe` and dumps.
    env.append({"name": GROUP_SECRET_FILE_ENV, "value": DEFAULT_GROUP_SECRET_FILE})
    env += [{"name": k, "value": v} for k, v in WRITABLE_ENV.items() if k not in user_names]
    return env + user


def group_secret_volume(cluster: str, group: int) -> dict[str, Any]:
    """The group's key of the cluster's Secret, alone, as the file the runtime reads."""
    return {
        "name": naming.GROUP_SECRET_VOLUME,
        "secret": {
            "secretName": naming.group_secret_name(cluster),
            "items": [{"key": naming.group_secret_key(group), "path": GROUP_SECRET_FILE_NAME}],
            "defaultMode": GROUP_SECRET_MODE,
        },
    }


def volumes_for(
    spec: InferenceClusterSpec, cluster: str = "", group: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): the group secret, the operator's writable emptyDirs (unless the user
    mounts that path), then the user's. The group secret cannot be replaced: a user volume of
    its name or a user mount at its path is left out (the pod policy refuses both anyway)."""
    template = spec.template
    user_mounts = [
        m for m in template.volume_mounts
        if m.get("mountPath") != GROUP_SECRET_MOUNT_DIR and m.get("name") != naming.GROUP_SECRET_VOLUME
    ]  # fmt: skip
    user_volumes = [v for v in template.volumes if v.get("name") not in naming.OPERATOR_VOLUMES]
    user_paths = {m.get("mountPath") for m in user_mounts}
    own = [(name, path, source) for name, path, source in WRITABLE_VOLUMES if path not in user_paths]
    volumes = [group_secret_volume(cluster, group)]
    volumes += [{"name": name, "emptyDir": dict(source)} for name, _, source in own]
    mounts = [{"name": naming.GROUP_SECRET_VOLUME, "mountPath": GROUP_SECRET_MOUNT_DIR, "readOnly": True}]
    mounts += [{"name": name, "mountPath": path} for name, path, _ in own]
    return volumes + copy.deepcopy(user_volumes), mounts + copy.deepcopy(user_mounts)


def pod_labels(ref: ClusterRef, group: int, stage: int, tp_rank: int | None, revision: str) -> dict[str, str]:
    """tp_rank None: a pod holding its stage's whole TP group (no TP rank of its own)."""
    labels = {
        **naming.MANAGED_BY,
        naming.CLUSTER_LABEL: ref.name,
        naming.GROUP_LABEL: str(group),
        naming.STAGE_LABEL: str(stage),
        naming.TP_RANK_LABEL: str(tp_rank),
        naming.ROLE_LABEL: naming.LEADER if stage == 0 and tp_rank in (0, None) else naming.WORKER,
        naming.REVISION_LABEL: revision,
    }
    if tp_rank is None:
        del labels[naming.TP_RANK_LABEL]
    return labels


def build_pod(
    ref: ClusterRef, spec: InferenceClusterSpec, revision: str, group: int, stage: int, tp_rank: int
) -> dict[str, Any]:
    """The pod of rank (stage, tp_rank); with stage pods (ranksPerPod), the pod of its stage, which
    runs the stage's ranks from tp_rank 0 on."""
    topology = topology_for(ref, spec, group, stage, tp_rank)
    pod_tp_rank = None if spec.stage_pods else tp_rank
    name = naming.pod_name(ref.name, group, stage, pod_tp_rank)
    template = spec.template
    volumes, mounts = volumes_for(spec, ref.name, group)
    container = rank_container(spec, topology, mounts)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ref.namespace,
            "labels": {
                **template.labels,
                **gang_labels(spec, ref.name, group, revision),
                **pod_labels(ref, group, stage, pod_tp_rank, revision),
            },
            "annotations": {
                **template.annotations,
                **gang_annotations(spec, ref.name, group, revision),
                naming.GROUP_SIZE_ANNOTATION: str(spec.pods_per_group),
            },
            "ownerReferences": [owner_reference(ref)],
        },
        "spec": rank_pod_spec(ref, spec, name, (group, stage), container, volumes),
    }
    model_cache.add_to_pod(pod, ref.name, spec, topology.is_leader)  # spec.model.cache
    return pod


def rank_container(
    spec: InferenceClusterSpec, topology: Topology, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The one container of a rank pod: confined, its ports, and (the leader's) readiness probe."""
    leader = topology.is_leader
    template = spec.template
    command, args = container_command(spec, leader)
    ports = [
        {"name": "dist", "containerPort": topology.dist_port, "protocol": "TCP"},
        {"name": "rpc", "containerPort": topology.rpc_port, "protocol": "TCP"},
    ]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "command": command,
        "args": args,
        "env": env_for(topology, spec),
        "ports": ports,
        "resources": resources_for(spec),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    container["lifecycle"] = {"preStop": {"exec": {"command": drain_command(spec, topology)}}}
    if leader:
        ports.append({"name": "http", "containerPort": topology.api_port, "protocol": "TCP"})
        # The runtime answers /health only after rendezvous and a warm-up forward pass: this probe
        # is the one source of the group's (and the cluster's) readiness.
        container["readinessProbe"] = {
            "httpGet": {"path": HEALTH_PATH, "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
            "timeoutSeconds": 3,
        }
    return container


def drain_command(spec: InferenceClusterSpec, topology: Topology) -> list[str]:
    """The preStop hook. When a group is deleted (rollout, scale-in) every pod is told at once: the
    leader serves on until the router (the pod is marked leaving) or the Service sends it nothing
    new, and until the requests it has are answered (`tessera drain`, polling its own count, at
    most rollout.drainSeconds); the workers wait for the same, then for its shutdown, computing
    for it rather than failing its requests by exiting first."""
    url = f"http://{'127.0.0.1' if topology.is_leader else topology.leader_addr}:{topology.api_port}"
    command = ["tessera", "drain", "--url", url, "--min-seconds", str(LEADER_DEREGISTER_SECONDS)]
    command += ["--timeout", str(spec.rollout.drain_seconds)]
    if not topology.is_leader:
        command += ["--linger", str(WORKER_LINGER_SECONDS)]
    return command


def rank_pod_spec(
    ref: ClusterRef,
    spec: InferenceClusterSpec,
    name: str,
    place: tuple[int, int],  # (group, stage): the pod-affinity term's
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
) -> dict[str, Any]:
    """A rank pod's spec: its stable DNS name, no API token, non-root, and the template's placement."""
    template = spec.template
    pod_spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": naming.headless_service_name(ref.name),
        "restartPolicy": "Never",  # the operator restarts whole groups, never single ranks
        "enableServiceLinks": False,
        # Ranks never call the Kubernetes API: no token in the pod (the spec cannot ask for one
        # either: its ServiceAccount and projected tokens pass the operator's pod policy).
        "automountServiceAccountToken": False,
        # 30 with the default drain, as before rollout.drainSeconds.
        "terminationGracePeriodSeconds": spec.rollout.drain_seconds + SHUTDOWN_SECONDS,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in template.image_pull_secrets]
    if template.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(template.tolerations)
    affinity = affinity_for(spec, ref.name, *place)
    if affinity:
        pod_spec["affinity"] = affinity
    if template.service_account_name:
        pod_spec["serviceAccountName"] = template.service_account_name
    if template.priority_class_name:
        pod_spec["priorityClassName"] = template.priority_class_name
    if (scheduler := scheduler_name(spec)) is not None:
        pod_spec["schedulerName"] = scheduler
    return pod_spec


# -- gang scheduling (spec.scheduling; docs/scheduling.md): what the rank pods carry -------------
# The keys each scheduler reads (Volcano's KubeGroupNameAnnotationKey; Kueue's plain pod groups).
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
KUEUE_TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
# A serving group never finishes: without it Kueue applies a batch job's completion rules (as
# LeaderWorkerSet's pods carry it).
KUEUE_SERVING_ANNOTATION = "kueue.x-k8s.io/pod-group-serving"
GANG_LABELS = (KUEUE_QUEUE_LABEL, KUEUE_GROUP_LABEL, KUEUE_PRIORITY_LABEL)
GANG_ANNOTATIONS = (VOLCANO_GROUP_ANNOTATION, KUEUE_TOTAL_ANNOTATION, KUEUE_SERVING_ANNOTATION)


def scheduler_name(spec: InferenceClusterSpec) -> str | None:
    """The rank pods' schedulerName; None: the cluster's default scheduler (Kueue's too)."""
    scheduling = spec.scheduling
    if scheduling.scheduler != "volcano":
        return None
    return (scheduling.volcano or VolcanoSpec()).scheduler_name


def gang_labels(spec: InferenceClusterSpec, cluster: str, group: int, revision: str) -> dict[str, str]:
    """Kueue's pod-group labels (none for the other schedulers): Kueue's webhook gates such pods
    and its controller admits the group whole; the operator only labels."""
    kueue = spec.scheduling.kueue
    if spec.scheduling.scheduler != "kueue" or kueue is None:
        return {}
    labels = {
        KUEUE_QUEUE_LABEL: kueue.queue_name,
        KUEUE_GROUP_LABEL: naming.pod_group_name(cluster, group, revision),
    }
    if kueue.priority_class is not None:
        labels[KUEUE_PRIORITY_LABEL] = kueue.priority_class
    return labels


def gang_annotations(spec: InferenceClusterSpec, cluster: str, group: int, revision: str) -> dict[str, str]:
    """Volcano: the PodGroup a pod belongs to; Kueue: how many pods the group has, and serving."""
    name = naming.pod_group_name(cluster, group, revision)
    if spec.scheduling.scheduler == "volcano":
        return {VOLCANO_GROUP_ANNOTATION: name}
    if spec.scheduling.scheduler == "kueue":
        return {KUEUE_TOTAL_ANNOTATION: str(spec.pods_per_group), KUEUE_SERVING_ANNOTATION: "true"}
    return {}


def build_group(
    ref: ClusterRef, spec: InferenceClusterSpec, revision: str, group: int
) -> list[dict[str, Any]]:
    """All pods of one replica group, leader first: one per rank, or one per stage (ranksPerPod)."""
    par = spec.parallelism
    return [
        build_pod(ref, spec, revision, group, stage, tp)
        for stage in range(par.pipeline)
        for tp in range(0, par.tensor, spec.template.ranks_per_pod)
    ]


def _service(ref: ClusterRef, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": ref.namespace,
            "labels": {**naming.MANAGED_BY, naming.CLUSTER_LABEL: ref.name},
            "ownerReferences": [owner_reference(ref)],
        },
        "spec": spec,
    }


def build_headless_service(ref: ClusterRef) -> dict[str, Any]:
    """Rendezvous: stable DNS per rank pod, published before readiness (ranks find the leader early)."""
    return _service(
        ref,
        naming.headless_service_name(ref.name),
        {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": naming.rank_selector(ref.name),
            "ports": [
                {"name": "dist", "port": DEFAULT_DIST_PORT, "targetPort": "dist", "protocol": "TCP"},
                {"name": "rpc", "port": DEFAULT_RPC_PORT, "targetPort": "rpc", "protocol": "TCP"},
            ],
        },
    )


def build_client_service(ref: ClusterRef, router: bool = False) -> dict[str, Any]:
    """What clients call: the OpenAI API of the router pods (`router`: spec.router.enabled), else of
    every Ready leader (a Service only routes to ready pods)."""
    selector = naming.router_selector(ref.name) if router else naming.rank_leader_selector(ref.name)
    return _service(
        ref,
        naming.client_service_name(ref.name),
        {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": DEFAULT_API_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    )


def build_disruption_budget(
    ref: ClusterRef, spec: InferenceClusterSpec, api_version: str, surge_groups: int = 0
) -> dict[str, Any] | None:
    """A node drain evicts one rank pod of the cluster at a time, and the next only once every
    pod is Ready again: one evicted rank takes its whole group down (the group restarts), so this
    takes groups down one by one while the others serve. The surge groups of a rollout count too:
    their pods are selected and healthy as soon as they run. None below two replicas: a drain
    must always be able to proceed, and one group cannot stay up through it anyway."""
    if spec.replicas < 2 or not spec.disruption_budget.enabled:
        return None
    pods = (spec.replicas + surge_groups) * spec.pods_per_group
    budget: dict[str, Any] = {
        # An integer minAvailable: the disruption controller counts the selected pods and needs
        # no scale subresource in pods (ours counts groups).
        "minAvailable": pods - 1,
        # Rank pods only: another pod with the cluster label (a client let through a
        # NetworkPolicy) would count as available and let a second rank go.
        "selector": {"matchLabels": naming.rank_selector(ref.name)},
    }
    if api_version == "policy/v1":  # 1.26+: a pod that is not Ready serves nothing; let it go
        budget["unhealthyPodEvictionPolicy"] = "AlwaysAllow"
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": ref.name,
            "namespace": ref.namespace,
            "labels": {**naming.MANAGED_BY, naming.CLUSTER_LABEL: ref.name},
            "ownerReferences": [owner_reference(ref)],
        },
        "spec": budget,
    }


def endpoint_of(ref: ClusterRef) -> str:
    return f"http://{naming.client_service_name(ref.name)}.{ref.namespace}.svc:{DEFAULT_API_PORT}/v1"


def _owned_metadata(ref: ClusterRef, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": {**naming.MANAGED_BY, naming.CLUSTER_LABEL: ref.name},
        "ownerReferences": [owner_reference(ref)],
    }


def new_group_secret_value(token: Callable[[int], bytes] = secrets.token_bytes) -> str:
    """A fresh group secret as a Secret's `data` holds it (base64)."""
    return base64.b64encode(token(GROUP_SECRET_BYTES)).decode()


def missing_group_keys(
    data: dict[str, str], groups: Iterable[int], token: Callable[[int], bytes] = secrets.token_bytes
) -> dict[str, str]:
    """New keys for the groups that have none in `data` (a Secret's); existing keys are never
    replaced: a group's running pods hold its key, and a new key would split the group."""
    return {
        key: new_group_secret_value(token)
        for key in sorted({naming.group_secret_key(g) for g in groups})
        if key not in data
    }


def build_group_secret(ref: ClusterRef, data: dict[str, str]) -> dict[str, Any]:
    """The cluster's Secret of group secrets (one key per group), owned by the cluster."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _owned_metadata(ref, naming.group_secret_name(ref.name)),
        "type": "Opaque",
        "data": dict(data),
    }


# Namespaces whose pods may read the leaders' /metrics (the operator's autoscaler): Kubernetes
# 1.20 has no kubernetes.io/metadata.name label to select the operator's namespace by name.
OPERATOR_NAMESPACE_LABELS = {"tessera.dev/operator": "true"}


def build_network_policies(ref: ClusterRef, spec: InferenceClusterSpec) -> list[dict[str, Any]]:
    """The NetworkPolicies of `spec.networkPolicy` (none when off), as examples/networkpolicy.yaml:
    rank pods take every TCP port from the cluster's rank pods; leaders take their HTTP port from
    the chosen clients and the operator's namespace. Pods are selected by the labels only the
    operator sets on the pods it makes (`naming.rank_selector`), not by the cluster label alone."""
    settings = spec.network_policy
    if not settings.enabled:
        return []
    ranks_name, clients_name = naming.network_policy_names(ref.name)
    ranks = {"matchLabels": naming.rank_selector(ref.name)}
    client: dict[str, Any] = {}
    if settings.client_namespace_selector is not None:
        client["namespaceSelector"] = {"matchLabels": dict(settings.client_namespace_selector)}
    if settings.client_pod_selector is not None:
        client["podSelector"] = {"matchLabels": dict(settings.client_pod_selector)}
    if not client:  # neither: the cluster's own namespace
        client["podSelector"] = {}
    operator = {"namespaceSelector": {"matchLabels": dict(OPERATOR_NAMESPACE_LABELS)}}
    callers = [client, operator]
    if spec.router.enabled:  # the router's pods, in the cluster's namespace (no policy selects them)
        callers.append({"podSelector": {"matchLabels": naming.router_selector(ref.name)}})

    def policy(name: str, selector: dict[str, Any], ingress: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _owned_metadata(ref, name),
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress},
        }

    return [
        # Every TCP port: gloo and NCCL connect ranks on ephemeral ports.
        policy(ranks_name, ranks, [{"from": [{"podSelector": ranks}]}]),
        policy(
            clients_name,
            {"matchLabels": naming.rank_leader_selector(ref.name)},
            [{"from": callers, "ports": [{"port": DEFAULT_API_PORT, "protocol": "TCP"}]}],
        ),
    ]
