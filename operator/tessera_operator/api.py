"""The InferenceCluster resource: pydantic models are the single source of its schema.

`crdgen.py` turns these models into the CRD's structural OpenAPI schema (`crds/`), the
reconciler parses objects with them, so the API server's defaults and the operator's
defaults can never disagree. Field names are camelCase on the wire.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from tessera_operator.bounded_json import excess
from tessera_operator.quantity import MAX_LENGTH as MAX_QUANTITY_LENGTH
from tessera_operator.quantity import QUANTITY_PATTERN

GROUP = "tessera.dev"
VERSION = "v1alpha1"
KIND = "InferenceCluster"
PLURAL = "inferenceclusters"
SINGULAR = "inferencecluster"
SHORT_NAMES = ["ic"]
API_VERSION = f"{GROUP}/{VERSION}"

QUEUE_DEPTH_METRIC = "tessera:num_requests_waiting"
# Caps that keep one object from asking for unbounded work; the operator's own cap on pods
# per cluster (replicas x pods per group, see podpolicy.py) is checked by the webhook and
# the reconciler, which can multiply.
MAX_REPLICAS = 256
MAX_LIST_ITEMS = 64  # volumes, mounts, tolerations, labels, ...: copied into every pod
MAX_ENV = 256
MAX_ENV_VALUE = 32 * 1024
MAX_ROUTER_REPLICAS = 64
MAX_TOKENS = 2**24  # context lengths and token budgets
MAX_DELAY_SECONDS = 7 * 24 * 3600  # restart delays: beyond this a timestamp is meaningless
# Leading '-' would turn a model name into a command-line flag of `tessera serve`.
NOT_A_FLAG = r"^[^-]"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # object names
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"  # Kubernetes' rule for environment variable names


# Kubernetes objects the operator passes through unchanged into the pod: the API server
# validates them when the pod is created, the CRD keeps them as free-form objects. The schema
# cannot bound their depth or total size (OpenAPI has no such keywords; maxProperties would bound
# one level's keys only), so their validator `bounded` does: Python's recursive walks (json,
# pydantic's dumps, hashing a revision) fail past some hundreds of levels, where the deepest pod
# field Kubernetes defines nests about 10.
MAX_FREE_FORM_DEPTH = 32
MAX_FREE_FORM_BYTES = 64 * 1024  # compact JSON of one field (a list: all its items together)


def free_form(description: str) -> Any:
    return Field(
        default=None,
        description=description,
        json_schema_extra={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    )


def free_form_list(description: str) -> Any:
    return Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description=description,
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )


def bounded(value: Any) -> Any:
    """A free-form field's validator (before any other): refused when it nests deeper than
    MAX_FREE_FORM_DEPTH or takes more than MAX_FREE_FORM_BYTES, measured without recursion."""
    found = excess(value, MAX_FREE_FORM_DEPTH, MAX_FREE_FORM_BYTES)
    if found is None:
        return value
    if found[0] == "depth":
        raise PydanticCustomError(
            "free_form_depth", "nests deeper than {max_depth} levels", {"max_depth": MAX_FREE_FORM_DEPTH}
        )
    raise PydanticCustomError(
        "free_form_size", "is larger than {max_bytes} bytes", {"max_bytes": MAX_FREE_FORM_BYTES}
    )


class Wire(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are rejected by the API server."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --- spec.model.cache (issue 62): a shared model cache -------------------------------------
AccessMode = Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]


def _read_write_many() -> list[AccessMode]:
    return ["ReadWriteMany"]


class ModelCacheSpec(Wire):
    """A PersistentVolumeClaim every rank pod mounts read-only, filled once per group (an init
    container of the group's leader pod converts the model into it, the other ranks' init
    containers wait for its .complete marker), so ranks and groups do not each convert the model
    into an emptyDir (docs/model-cache.md)."""

    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="An existing claim to use (never changed or deleted by the operator); unset: the "
        "operator makes `<cluster>-model-cache`, owned by the cluster (deleted with it).",
    )
    size: Annotated[str, Field(max_length=MAX_QUANTITY_LENGTH, pattern=QUANTITY_PATTERN)] = Field(
        default="20Gi", description="Storage the claim the operator makes requests."
    )
    storage_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="StorageClass of the claim the operator makes (unset: the cluster's default class).",
    )
    access_modes: list[AccessMode] = Field(
        default_factory=_read_write_many,
        min_length=1,
        max_length=4,
        description="Access modes of the claim the operator makes (ReadWriteMany: groups on many nodes).",
    )
    wait_seconds: float = Field(
        default=1800,
        ge=1,
        le=MAX_DELAY_SECONDS,
        description="A rank pod waits at most this long for its group's fill, then fails with the reason.",
    )

    @model_validator(mode="after")
    def _one_claim(self) -> ModelCacheSpec:
        # The named claim is used as it is: a class for it would say something that never happens.
        if self.claim_name and self.storage_class_name:
            raise PydanticCustomError(
                "claim_and_class", "claimName names an existing claim: storageClassName is for the one made"
            )
        return self


class ModelSpec(Wire):
    """Which model every rank loads."""

    source: str = Field(
        min_length=1,
        max_length=1024,
        pattern=NOT_A_FLAG,
        description="Model alias (e.g. smollm2-135m-instruct), local Hugging Face folder, or .gguf file.",
    )
    served_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=NOT_A_FLAG,
        description="Name clients use in the OpenAI API (default: the source).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weight and activation dtype."
    )
    max_model_len: int | None = Field(
        default=None,
        ge=2,  # a prompt token and a generated one
        le=MAX_TOKENS,
        description="Maximum context length (default: the model's).",
    )
    cache: ModelCacheSpec | None = Field(
        default=None, description="A shared model cache (a PersistentVolumeClaim) filled once per group."
    )


class ParallelismSpec(Wire):
    """How one replica group splits the model: ranks per group = tensor x pipeline (pods per
    group: InferenceClusterSpec.pods_per_group)."""

    tensor: int = Field(default=1, ge=1, le=64, description="Tensor-parallel ranks per pipeline stage.")
    pipeline: int = Field(default=1, ge=1, le=64, description="Pipeline stages.")
    sequence_parallel: bool = Field(
        default=False, description="Shard activations over tokens inside a TP group (needs tensor > 1)."
    )
    expert_parallel: bool = Field(
        default=False,
        description="Spread a mixture-of-experts model's experts over the tensor-parallel ranks of a "
        "stage, each expert whole on one rank (vLLM's --enable-expert-parallel); needs tensor > 1 to "
        "have an effect, and a model whose experts divide by tensor.",
    )
    layer_partition: list[int] | None = Field(
        default=None,
        description="Layers per pipeline stage, e.g. [16, 14]; length must equal pipeline (default: even split).",
        max_length=64,
        json_schema_extra={"items": {"type": "integer", "minimum": 1, "maximum": 1_000_000}},
    )


class SamplingDefaultsSpec(Wire):
    """Sampling for what a request leaves unset, over the model's generation config (vLLM's
    --override-generation-config)."""

    temperature: float | None = Field(default=None, ge=0.0, le=1e4, description="Sampling temperature.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1, description="Top-k (-1: off).")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="Minimum probability.")
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, le=1e4, description="Repetition penalty (1: off)."
    )
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS, description="Caps every request's max_tokens."
    )


class EngineSpec(Wire):
    """Engine settings passed to every rank's `tessera` command."""

    max_num_seqs: int = Field(
        default=128, ge=1, le=65536, description="Maximum sequences per scheduler step."
    )
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, le=MAX_TOKENS, description="Token budget per scheduler step."
    )
    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV cache block.")
    # A resource quantity, a string or a plain number of bytes, as Kubernetes' own quantities take.
    kv_cache_memory: (
        Annotated[int, Field(ge=0)]
        | Annotated[str, Field(max_length=MAX_QUANTITY_LENGTH, pattern=QUANTITY_PATTERN)]
        | None
    ) = Field(
        default=None,
        description="KV cache size per rank as a resource quantity (e.g. 2Gi, or bytes); default: the engine's.",
    )
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV blocks of shared prefixes.")
    enable_chunked_prefill: bool = Field(default=True, description="Split long prompts across steps.")
    generation_config: Literal["auto", "vllm"] = Field(
        default="auto",
        description="Sampling defaults for what a request leaves unset: auto (the model's "
        "generation_config.json, as vLLM) or vllm (the engine's own).",
    )
    sampling_defaults: SamplingDefaultsSpec | None = Field(
        default=None, description="Sampling defaults over the generation config."
    )
    max_waiting_requests: int | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="The leader answers 503 + Retry-After past this many sequences waiting for the "
        "engine (tessera serve --max-waiting-requests); default: the runtime's own, from the KV cache.",
    )
    metrics_prefix: Literal["tessera", "vllm", "both"] = Field(
        default="tessera",
        description="The name prefix of the leaders' /metrics series (tessera serve --metrics-prefix): "
        "vllm or both for what reads vLLM's names (vllm:num_requests_waiting: KEDA triggers, "
        "dashboards, an InferencePool's Endpoint Picker); spec.autoscaling reads tessera's.",
    )


class EnvVar(Wire):
    name: str = Field(min_length=1, max_length=256, pattern=ENV_NAME_PATTERN, description="Variable name.")
    value: str | None = Field(default=None, max_length=MAX_ENV_VALUE, description="Literal value.")
    value_from: dict[str, Any] | None = free_form("A Kubernetes EnvVarSource.")

    _bounded = field_validator("value_from", mode="before")(bounded)


class TemplateSpec(Wire):
    """What every rank pod looks like; the user's fields are merged into the operator's pod."""

    image: str = Field(
        default="localhost/tessera/runtime-cpu:0.1.0",
        min_length=1,
        max_length=512,
        pattern=r"^\S+$",  # whitespace passes the API server and fails every pull on the node
        description="Runtime image. The default names a local build (localhost/: no public registry "
        "serves it, so a forgotten override fails to pull rather than pull a stranger's image).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    image_pull_secrets: list[Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]] = (
        Field(
            default_factory=list,
            max_length=MAX_LIST_ITEMS,
            description="Secrets (kubernetes.io/dockerconfigjson, in the cluster's namespace) the kubelet pulls "
            "the image with; the pods cannot read them.",
        )
    )
    resources: dict[str, Any] | None = free_form("Container resources (requests, limits) of every rank.")
    gpus_per_rank: int = Field(
        default=0,
        ge=0,
        le=1,  # a rank runs on one device: a second would sit idle, reserved from everyone else
        description="Accelerators per rank (0 or 1: a rank runs on one); a pod requests "
        "gpusPerRank x ranksPerPod of them (requests and limits).",
    )
    ranks_per_pod: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ranks per pod: 1 (a pod per rank) or parallelism.tensor (a pod per pipeline stage "
        "holding the stage's whole tensor-parallel group as local processes, one pod per node as "
        "LeaderWorkerSet runs it: NVLink between the stage's GPUs, pipeline stages across pods).",
    )
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu", min_length=1, description="Extended resource name of the accelerator."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_LIST_ITEMS, description="Node selector of every rank."
    )
    tolerations: list[dict[str, Any]] = free_form_list("Pod tolerations.")
    affinity: dict[str, Any] | None = free_form(
        "Pod affinity; the operator adds its TP co-location term to it."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_ENV,
        description="Extra environment (the topology variables cannot be overridden).",
        # Keyed by name, as a pod's env: one entry per name, and server-side apply merges per entry.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    volumes: list[dict[str, Any]] = free_form_list("Extra pod volumes.")
    volume_mounts: list[dict[str, Any]] = free_form_list("Extra container volume mounts.")
    service_account_name: str | None = Field(
        default=None,
        description="ServiceAccount of the rank pods; only one the operator allows (--allowed-service-accounts).",
    )
    priority_class_name: str | None = Field(
        default=None,
        description="PriorityClass of the rank pods; only one the operator allows (--allowed-priority-classes).",
    )
    labels: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_LIST_ITEMS, description="Extra pod labels."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_LIST_ITEMS, description="Extra pod annotations."
    )

    _bounded = field_validator(
        "resources", "tolerations", "affinity", "volumes", "volume_mounts", mode="before"
    )(bounded)


class PlacementSpec(Wire):
    """Keep the TP ranks of one stage together (NVLink); stages and groups may spread."""

    mode: Literal["preferred", "required", "none"] = Field(
        default="preferred", description="How strongly the TP ranks of a stage are co-located."
    )
    topology_key: str = Field(
        default="kubernetes.io/hostname", min_length=1, description="Node label that defines 'together'."
    )


class RolloutSpec(Wire):
    """Rolling update of replica groups; counts are whole groups, not pods."""

    max_unavailable: int = Field(
        default=1, ge=0, le=MAX_REPLICAS, description="Groups that may be unavailable during an update."
    )
    max_surge: int = Field(
        default=0, ge=0, le=MAX_REPLICAS, description="Extra groups created above replicas during an update."
    )
    progress_deadline_seconds: float = Field(
        default=600,
        ge=0,
        le=MAX_DELAY_SECONDS,
        description="A group whose pods cannot start this long (unschedulable, an image that is not "
        "pulled), or that keeps failing this long without a Ready run, makes the cluster Stalled, "
        "reason ProgressDeadlineExceeded: GitOps tools stop waiting.",
    )
    drain_seconds: int = Field(
        default=20,
        ge=0,
        le=3600,
        description="A deleted group's leader (rollout, scale-in) answers what it has open, for at "
        "most this long, before it stops (its preStop hook, tessera drain); its pods' "
        "terminationGracePeriodSeconds is this + 10. Groups made after a change get it.",
    )


class EndpointPickerSpec(Wire):
    """The Endpoint Picker (an ext-proc service, e.g. llm-d's or the Gateway API inference
    extension's) that a Gateway asks which leader of the InferencePool takes a request."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="Its Service.")
    port: int = Field(default=9002, ge=1, le=65535, description="Its ext-proc port (default 9002).")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose", description="What the Gateway does when the picker does not answer."
    )


class RouterSpec(Wire):
    """`tessera router` in front of the group leaders (docs/router.md): a Deployment the client
    Service selects, scoring leaders by load and session affinity, holding requests at zero."""

    enabled: bool = Field(
        default=True,
        description="Run the router and point the client Service at it; off: the Service selects the "
        "Ready leaders (round robin).",
    )
    replicas: int = Field(default=1, ge=1, le=MAX_ROUTER_REPLICAS, description="Router pods.")
    resources: dict[str, Any] | None = free_form("Container resources (requests, limits) of the router.")
    hold_seconds: float = Field(
        default=30,
        ge=0,
        le=3600,
        description="With no leader Ready (scaled to zero, a rollout), a request waits this long for one "
        "(tessera router --hold-timeout), then gets 503 + Retry-After.",
    )
    max_held_requests: int = Field(
        default=256,
        ge=0,
        le=1_000_000,
        description="Requests held at once with no leader Ready (tessera router --hold-max; 0: a 503 at once).",
    )
    inference_pool: bool = Field(
        default=False,
        description="Also keep an InferencePool (inference.networking.k8s.io/v1) of the leaders for a "
        "Gateway API inference extension (needs endpointPicker); where its CRD is not installed, "
        "none, and the cluster reads Degraded, reason InferencePoolUnavailable.",
    )
    endpoint_picker: EndpointPickerSpec | None = Field(
        default=None,
        description="The InferencePool's endpointPickerRef (InferencePool v1 requires one; tessera "
        "router is a proxy, not an Endpoint Picker).",
    )

    _bounded = field_validator("resources", mode="before")(bounded)


class RestartPolicySpec(Wire):
    """Whole-group restart after any rank fails, with exponential backoff per group."""

    backoff_base_seconds: float = Field(
        default=10, ge=0, le=MAX_DELAY_SECONDS, description="Delay before the first restart."
    )
    backoff_max_seconds: float = Field(
        default=300, ge=0, le=MAX_DELAY_SECONDS, description="Upper bound of the delay."
    )
    reset_after_seconds: float = Field(
        default=600,
        ge=0,
        le=MAX_DELAY_SECONDS,
        description="A group Ready this long starts its backoff from the base again.",
    )


class DisruptionBudgetSpec(Wire):
    """The PodDisruptionBudget the operator keeps from two replicas on (node drains, evictions)."""

    enabled: bool = Field(
        default=True,
        description="Keep a PodDisruptionBudget (minAvailable: every pod but one) while replicas >= 2: "
        "a drain evicts one rank, then waits until every pod is Ready again, so groups go down one at "
        "a time. Off: evictions are not limited (a group that cannot become Ready then never blocks a "
        "drain).",
    )


class AutoscalingSpec(Wire):
    """Queue-depth autoscaling of replica groups (the operator's own autoscaler, HPA's rules)."""

    enabled: bool = Field(
        default=False,
        description="Let the operator's autoscaler set spec.replicas (through the scale subresource) "
        "from the queue depth its Ready leaders report.",
    )
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description="Fewest groups. 0 (needs spec.router): the last group goes after "
        "scaleToZeroSeconds without a request, and one comes back when a request reaches the router.",
    )
    max_replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS, description="Most groups.")
    metric: Literal["tessera:num_requests_waiting"] = Field(
        default="tessera:num_requests_waiting",
        description="Per-replica gauge the autoscaler reads from each Ready leader's /metrics.",
    )
    target_queue_depth: float = Field(
        default=8, gt=0, le=1_000_000, description="Target waiting requests per replica group."
    )
    scale_down_stabilization_seconds: float = Field(
        default=300,
        ge=0,
        le=MAX_DELAY_SECONDS,
        description="Scale down only to the highest recommendation of this window (HPA's default: 300).",
    )
    scale_to_zero_seconds: float = Field(
        default=600,
        ge=0,
        le=MAX_DELAY_SECONDS,
        description="With minReplicas 0: how long the cluster goes without a request (none reaching "
        "the router, none open, none waiting) before its last group goes.",
    )


class NetworkPolicySpec(Wire):
    """The NetworkPolicies the operator keeps for the cluster (docs/SECURITY.md, "Network")."""

    enabled: bool = Field(
        default=False,
        description="Keep two NetworkPolicies: between the cluster's rank pods every TCP port; to the "
        "leaders' HTTP port only from the clients chosen here and from namespaces labelled "
        "tessera.dev/operator=true (the autoscaler reads /metrics). Needs a network plugin that "
        "enforces NetworkPolicies.",
    )
    client_namespace_selector: dict[str, str] | None = Field(
        default=None,
        max_length=MAX_LIST_ITEMS,
        description="Labels (matchLabels) of the namespaces whose pods may call the leaders' HTTP API. "
        "Neither this nor clientPodSelector: every pod of the cluster's own namespace.",
    )
    client_pod_selector: dict[str, str] | None = Field(
        default=None,
        max_length=MAX_LIST_ITEMS,
        description="Labels (matchLabels) of the client pods that may call the leaders' HTTP API (in "
        "the namespaces of clientNamespaceSelector, or without it in the cluster's own namespace).",
    )


# -- gang scheduling (spec.scheduling; docs/scheduling.md) ----------------------------------------
# A group's pods are useless until every one runs: a gang scheduler places all of them or none.
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"  # Kubernetes' label value syntax


class VolcanoSpec(Wire):
    """Volcano: a PodGroup (scheduling.volcano.sh/v1beta1) per replica group, minMember = its pods."""

    scheduler_name: str = Field(
        default="volcano",
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="The rank pods' schedulerName: the name Volcano's scheduler runs under.",
    )
    queue: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="The Volcano Queue of every PodGroup (default: Volcano's, `default`).",
    )
    priority_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="The PodGroups' PriorityClass, which orders and preempts whole groups (default: "
        "spec.template.priorityClassName); only one the operator allows (--allowed-priority-classes).",
    )


class KueueSpec(Wire):
    """Kueue: each replica group a plain pod group (its pods labelled; Kueue gates and admits them)."""

    queue_name: str = Field(
        min_length=1,
        max_length=63,
        pattern=LABEL_VALUE,
        description="The LocalQueue (in the cluster's namespace) every group is submitted to.",
    )
    priority_class: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=LABEL_VALUE,
        description="A Kueue WorkloadPriorityClass of the groups (label kueue.x-k8s.io/priority-class).",
    )


class SchedulingSpec(Wire):
    """Which scheduler places the rank pods, and how a replica group is made a gang."""

    scheduler: Literal["default", "volcano", "kueue"] = Field(
        default="default",
        description="default: the cluster's scheduler, pod by pod; volcano: a PodGroup per group "
        "(spec.scheduling.volcano); kueue: Kueue's pod-group labels (spec.scheduling.kueue). A change "
        "rolls the groups (a pod's schedulerName cannot change).",
    )
    volcano: VolcanoSpec | None = Field(
        default=None, description="Volcano's settings (scheduler volcano only; default: all defaults)."
    )
    kueue: KueueSpec | None = Field(default=None, description="Kueue's settings (scheduler kueue, needed).")


class InferenceClusterSpec(Wire):
    model: ModelSpec = Field(description="The model served.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Parallel layout.")
    replicas: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description=f"Replica (data-parallel) groups, at most {MAX_REPLICAS}; the operator also caps "
        "pods per cluster ((max(replicas, autoscaling.maxReplicas) + rollout.maxSurge) x pods per group: "
        "tensor x pipeline / template.ranksPerPod).",
    )
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings.")
    template: TemplateSpec = Field(default_factory=TemplateSpec, description="Rank pod template.")
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="Rank placement.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rolling update policy.")
    restart_policy: RestartPolicySpec = Field(
        default_factory=RestartPolicySpec, description="Group restart policy."
    )
    autoscaling: AutoscalingSpec | None = Field(default=None, description="Queue-depth autoscaling.")
    disruption_budget: DisruptionBudgetSpec = Field(
        default_factory=DisruptionBudgetSpec, description="Eviction limits for node drains."
    )
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="NetworkPolicies the operator keeps for the cluster."
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router in front of the leaders.")
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec, description="Gang scheduling of each replica group's pods."
    )

    @property
    def pods_per_stage(self) -> int:
        """A stage's pods: one per TP rank, or one holding them all (template.ranksPerPod)."""
        return max(self.parallelism.tensor // self.template.ranks_per_pod, 1)

    @property
    def pods_per_group(self) -> int:
        """The one count of a replica group's pods: its desired pods, its PDB share, the pod cap."""
        return self.pods_per_stage * self.parallelism.pipeline

    @property
    def stage_pods(self) -> bool:
        """Each pod holds a whole stage (named `<cluster>-g<group>-s<stage>`), not one rank."""
        return self.template.ranks_per_pod > 1


GroupPhase = Literal["Pending", "Starting", "Ready", "Failed", "BackingOff", "Updating", "Terminating"]


class GroupStatus(Wire):
    index: int = Field(description="Replica group index.")
    revision: str | None = Field(default=None, description="Revision of the group's pods.")
    phase: GroupPhase = Field(default="Pending", description="Lifecycle phase of the group.")
    pods: int = Field(default=0, description="Pods of the group (existing, or created by the last pass).")
    ready: bool = Field(default=False, description="The leader's readiness probe passes.")
    restarts: int = Field(default=0, description="Consecutive group restarts (drives the backoff).")
    last_failure: str | None = Field(default=None, description="Reason of the last failure.")
    last_failure_time: str | None = Field(default=None, description="When the last failure was seen.")
    backoff_seconds: float | None = Field(default=None, description="Current restart delay.")
    next_restart_time: str | None = Field(default=None, description="Earliest time of the next restart.")
    ready_since: str | None = Field(default=None, description="Since when the group is Ready.")
    start_problem: str | None = Field(
        default=None, description="Why its pods do not start (Unschedulable, ImagePullBackOff, ...)."
    )
    start_problem_since: str | None = Field(default=None, description="Since when they do not start.")
    surge: bool | None = Field(
        default=None, description="Created above spec.replicas for a rollout: removed once it is done."
    )
    failing_since: str | None = Field(
        default=None,
        description="First failure of restarts with no Ready run between (past the progress deadline: Stalled).",
    )
    complete: bool | None = Field(
        default=None,
        description="Every rank's pod was seen since the group was last made: a pod missing now was taken away.",
    )


class Condition(Wire):
    type: Literal["Ready", "Progressing", "Degraded", "Reconciling", "Stalled"] = Field(
        description="Condition type (Reconciling and Stalled are kstatus', which Flux and kpt read)."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Condition status.")
    reason: str = Field(default="", description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(default=None, description="When the status last changed.")
    observed_generation: int | None = Field(default=None, description="Generation the condition is about.")


# A new object's status until the operator writes one (the CRD's default for `status`): with no
# condition at all, kstatus (Flux's health checks, kpt) would read it as Current at once, even
# with no operator running.
AWAITING_OPERATOR = Condition(
    type="Reconciling",
    status="True",
    reason="AwaitingOperator",
    message="the operator has not reconciled this object yet",
)


class AutoscalingStatus(Wire):
    queue_depth: float | None = Field(
        default=None, description="Requests waiting at the Ready leaders at the last sample."
    )
    measured_replicas: int = Field(default=0, description="Groups whose leader answered the last sample.")
    desired_replicas: int | None = Field(default=None, description="What the autoscaler last asked for.")
    last_sample_time: str | None = Field(default=None, description="When the leaders were last sampled.")
    last_scale_time: str | None = Field(
        default=None, description="When the autoscaler last changed replicas."
    )


class InferenceClusterStatus(Wire):
    observed_generation: int | None = Field(default=None, description="Last generation reconciled.")
    replicas: int = Field(default=0, description="Groups that exist (including surge groups).")
    ready_replicas: int = Field(default=0, description="Groups whose leader is Ready.")
    updated_replicas: int = Field(default=0, description="Groups at the current revision.")
    # No empty-string defaults: Kubernetes 1.20 turns them into null and rejects the write.
    selector: str | None = Field(
        default=None, description="Label selector of the leader pods (scale subresource)."
    )
    current_revision: str | None = Field(default=None, description="Revision every group runs once settled.")
    update_revision: str | None = Field(default=None, description="Revision of the current spec.")
    endpoint: str | None = Field(
        default=None, description="OpenAI-compatible base URL of the client Service."
    )
    groups: list[GroupStatus] = Field(default_factory=list, description="Per-group state.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded; Reconciling and Stalled for kstatus.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    autoscaling: AutoscalingStatus | None = Field(
        default=None, description="The queue-depth autoscaler's last sample and decision."
    )
    applied_spec: dict[str, Any] | None = free_form(
        "The last spec the operator accepted: while a newer one is refused (InvalidSpec), the "
        "groups keep running and are repaired as this one says."
    )


class InferenceCluster(Wire):
    api_version: str = API_VERSION
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: InferenceClusterSpec
    status: InferenceClusterStatus = Field(default_factory=InferenceClusterStatus)
