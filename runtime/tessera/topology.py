"""The topology contract between the operator (writes it) and the runtime (reads it).

Importable without torch: the operator imports this module to write each pod's
environment, the runtime imports it to read its own place, so the two can never
disagree. Rank layout: tensor parallelism is the innermost dimension,
``rank = pp_rank * tp_size + tp_rank``; rank 0 (stage 0, TP rank 0) is the leader.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_DIST_PORT = 29500
DEFAULT_RPC_PORT = 29600
DEFAULT_API_PORT = 8000

# The group's shared secret, which authenticates every rank to its leader and to the rendezvous
# (docs/SECURITY.md, "Rank traffic"). A file, never an environment value (environment dumps and
# `kubectl describe` show those): the operator mounts key GROUP_SECRET_KEY of the Secret
# `naming.group_secret_name(cluster)` (one key per group, `group-<index>`, projected to this file
# name) at GROUP_SECRET_MOUNT_DIR, and `tessera serve --tp/--pp` writes a random one, mode 0600.
GROUP_SECRET_FILE_ENV = "TESSERA_GROUP_SECRET_FILE"
GROUP_SECRET_MOUNT_DIR = "/etc/tessera/group-secret"
GROUP_SECRET_FILE_NAME = "secret"
DEFAULT_GROUP_SECRET_FILE = f"{GROUP_SECRET_MOUNT_DIR}/{GROUP_SECRET_FILE_NAME}"


# How many ranks one pod runs as local processes: the rank its environment names and the next
# ones of the same stage (the operator's spec.template.ranksPerPod, written only when above one).
# Each process then gets its own rank's environment, with LOCAL_RANK its index in the pod.
LOCAL_RANKS_ENV = "TESSERA_LOCAL_RANKS"


class TopologyError(ValueError):
    """The topology environment is missing or inconsistent; the message names the variable."""


def split_layers(
    num_layers: int, pp_size: int, partition: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Return the [start, end) layer range of every pipeline stage.

    An explicit partition wins. Otherwise layers split evenly and the remainder
    goes to the middle stages first (then the first), never the last: the last
    stage also computes logits and samples, so it gets the lightest share.
    """
    if pp_size < 1:
        raise TopologyError(f"pipeline size must be >= 1, got {pp_size}")
    if partition is not None:
        if len(partition) != pp_size:
            raise TopologyError(
                f"TESSERA_LAYER_PARTITION has {len(partition)} entries but the pipeline has {pp_size} stages"
            )
        if any(n < 1 for n in partition):
            raise TopologyError(f"TESSERA_LAYER_PARTITION entries must be >= 1, got {partition}")
        if sum(partition) != num_layers:
            raise TopologyError(
                f"TESSERA_LAYER_PARTITION {partition} sums to {sum(partition)}, the model has {num_layers} layers"
            )
        sizes = list(partition)
    else:
        if num_layers < pp_size:
            raise TopologyError(f"cannot split {num_layers} layers into {pp_size} pipeline stages")
        base, remainder = divmod(num_layers, pp_size)
        sizes = [base] * pp_size
        middle = [*range(1, pp_size - 1), 0]
        for stage in middle[:remainder]:
            sizes[stage] += 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class RankPlacement:
    """Which share of the model one rank holds: its tensor-parallel slot, its pipeline stage and
    how the layers split over the stages. The model and its layers are built from it (they never
    read ranks from the process groups); ``Topology.placement`` gives a rank its own. A new way
    of splitting the model (experts over ranks) adds its slot here, and the layers that split
    by it read it, without a new argument threaded through every constructor."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layer_partition: tuple[int, ...] | None = None  # layers per stage; None: an even split
    sequence_parallel: bool = False
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise TopologyError(f"tensor-parallel rank {self.tp_rank} outside a group of {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise TopologyError(f"pipeline rank {self.pp_rank} outside a pipeline of {self.pp_size}")
        if self.layer_partition is not None:  # a list given is kept as a tuple: the value stays frozen
            object.__setattr__(self, "layer_partition", tuple(self.layer_partition))

    @property
    def shards_tokens(self) -> bool:
        """Sequence parallelism in effect: between the linears each TP rank holds a shard of the
        tokens (with one TP rank there is nothing to shard)."""
        return self.sequence_parallel and self.tp_size > 1

    @property
    def shards_experts(self) -> bool:
        """Expert parallelism in effect: a mixture-of-experts layer's experts are spread over the
        TP ranks of a stage, each whole on one rank (with one TP rank every expert is local)."""
        return self.expert_parallel and self.tp_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_layers(self, num_layers: int) -> tuple[int, int]:
        """The [start, end) range of the layers this rank's stage runs."""
        return split_layers(num_layers, self.pp_size, self.layer_partition)[self.pp_rank]


# One rank holding the whole model.
SINGLE_RANK = RankPlacement()


def parse_partition(text: str | None) -> list[int] | None:
    if text is None or not text.strip():
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError as exc:
        raise TopologyError(
            f"TESSERA_LAYER_PARTITION must be comma-separated integers, got {text!r}"
        ) from exc


class ParallelLayout(BaseModel):
    """How one replica splits a model: the one definition, and the one check, of tp/pp/sp/partition.

    ``EngineConfig.parallel`` is one, ``Topology.layout`` is one, the CLI flags are generated from
    its fields and the environment contract reads and writes it, so no two places can disagree.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1, le=1024, description="tensor-parallel ranks per stage")
    pipeline_parallel_size: int = Field(1, ge=1, le=1024, description="pipeline stages")
    sequence_parallel: bool = Field(
        False, description="shard activations over tokens inside a TP group (needs tensor_parallel_size > 1)"
    )
    layer_partition: list[int] | None = Field(
        None, description="layers per pipeline stage, e.g. 16,14 (default: an even split)"
    )
    enable_expert_parallel: bool = Field(
        False,
        description="mixture-of-experts models: spread the experts over the TP ranks of a stage, each "
        "whole on one rank, tokens dispatched to them (vLLM's flag); dense models ignore it",
    )

    @model_validator(mode="after")
    def _check(self) -> ParallelLayout:
        if self.sequence_parallel and self.tensor_parallel_size < 2:
            raise ValueError("sequence_parallel needs tensor_parallel_size > 1")
        if self.layer_partition is not None:
            if len(self.layer_partition) != self.pipeline_parallel_size:
                raise ValueError(
                    f"layer_partition has {len(self.layer_partition)} entries but "
                    f"pipeline_parallel_size is {self.pipeline_parallel_size}"
                )
            if any(n < 1 for n in self.layer_partition):
                raise ValueError(f"layer_partition entries must be >= 1, got {self.layer_partition}")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_layers(self, num_layers: int) -> list[tuple[int, int]]:
        return split_layers(num_layers, self.pipeline_parallel_size, self.layer_partition)


# The environment variable that carries each ParallelLayout field (error messages name them).
LAYOUT_ENV = {
    "tensor_parallel_size": "TESSERA_TP_SIZE",
    "pipeline_parallel_size": "TESSERA_PP_SIZE",
    "sequence_parallel": "TESSERA_SEQUENCE_PARALLEL",
    "layer_partition": "TESSERA_LAYER_PARTITION",
    "enable_expert_parallel": "TESSERA_EXPERT_PARALLEL",
}


class Topology(BaseModel):
    """One rank's place in a replica group, and where to find the group's leader."""

    model_config = ConfigDict(frozen=True)

    cluster: str = "local"
    namespace: str = "default"
    group: int = Field(0, ge=0)
    layout: ParallelLayout = Field(default_factory=ParallelLayout)
    tp_rank: int = Field(0, ge=0)
    pp_rank: int = Field(0, ge=0)
    leader_addr: str = "127.0.0.1"
    dist_port: int = Field(DEFAULT_DIST_PORT, ge=1, le=65535)
    rpc_port: int = Field(DEFAULT_RPC_PORT, ge=1, le=65535)
    api_port: int = Field(DEFAULT_API_PORT, ge=1, le=65535)

    @model_validator(mode="after")
    def _check(self) -> Topology:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"TESSERA_TP_RANK={self.tp_rank} must be < TESSERA_TP_SIZE={self.tp_size}")
        if self.pp_rank >= self.pp_size:
            raise ValueError(f"TESSERA_PP_RANK={self.pp_rank} must be < TESSERA_PP_SIZE={self.pp_size}")
        return self

    @property
    def tp_size(self) -> int:
        return self.layout.tensor_parallel_size

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline_parallel_size

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    @property
    def layer_partition(self) -> list[int] | None:
        return self.layout.layer_partition

    @property
    def expert_parallel(self) -> bool:
        return self.layout.enable_expert_parallel

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def placement(self) -> RankPlacement:
        """This rank's share of the model."""
        layout = self.layout
        return RankPlacement(
            tp_rank=self.tp_rank,
            tp_size=layout.tensor_parallel_size,
            pp_rank=self.pp_rank,
            pp_size=layout.pipeline_parallel_size,
            layer_partition=None if layout.layer_partition is None else tuple(layout.layer_partition),
            sequence_parallel=layout.sequence_parallel,
            expert_parallel=layout.enable_expert_parallel,
        )

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def for_rank(self, rank: int) -> Topology:
        """The same group seen from another rank (used to launch local rank processes)."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside world of size {self.world_size}")
        pp_rank, tp_rank = divmod(rank, self.tp_size)
        return self.model_copy(update={"pp_rank": pp_rank, "tp_rank": tp_rank})

    def to_env(self, local_ranks: int = 1) -> dict[str, str]:
        """The environment a rank process (or pod) receives; torch's own names carry the same values.

        ``local_ranks``: a pod running this rank and the next ones of its stage (LOCAL_RANKS_ENV)."""
        env = {
            "TESSERA_CLUSTER": self.cluster,
            "TESSERA_NAMESPACE": self.namespace,
            "TESSERA_GROUP": str(self.group),
            "TESSERA_TP_SIZE": str(self.tp_size),
            "TESSERA_PP_SIZE": str(self.pp_size),
            "TESSERA_SEQUENCE_PARALLEL": "true" if self.sequence_parallel else "false",
            "TESSERA_TP_RANK": str(self.tp_rank),
            "TESSERA_PP_RANK": str(self.pp_rank),
            "TESSERA_RANK": str(self.rank),
            "TESSERA_WORLD_SIZE": str(self.world_size),
            "TESSERA_LEADER_ADDR": self.leader_addr,
            "TESSERA_DIST_PORT": str(self.dist_port),
            "TESSERA_RPC_PORT": str(self.rpc_port),
            "TESSERA_API_PORT": str(self.api_port),
            "MASTER_ADDR": self.leader_addr,
            "MASTER_PORT": str(self.dist_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            # One rank per pod: the device plugin shows a container only its own GPUs, numbered
            # from 0, so the rank's device is cuda:0 (local processes get their index instead).
            "LOCAL_RANK": "0",
        }
        if self.layer_partition is not None:
            env["TESSERA_LAYER_PARTITION"] = ",".join(str(n) for n in self.layer_partition)
        if self.expert_parallel:  # only when on: pods of dense layouts keep the environment they had
            env["TESSERA_EXPERT_PARALLEL"] = "true"
        if local_ranks != 1:  # only then: one-rank pods keep the environment they had
            env[LOCAL_RANKS_ENV] = str(local_ranks)
        return env

    def local_ranks(self, environ: Mapping[str, str]) -> list[int]:
        """The ranks this pod runs (LOCAL_RANKS_ENV, default one): this rank and the next ones of
        its stage, never past it (a pod holds a stage's TP ranks, stages span pods)."""
        count = read_int(environ, LOCAL_RANKS_ENV, 1)
        if count < 1:
            raise TopologyError(f"{LOCAL_RANKS_ENV} must be >= 1, got {count}")
        if self.tp_rank + count > self.tp_size:
            raise TopologyError(
                f"{LOCAL_RANKS_ENV}={count} from TESSERA_TP_RANK={self.tp_rank} runs past the stage's "
                f"TESSERA_TP_SIZE={self.tp_size} ranks: a pod holds ranks of one stage only"
            )
        return [self.rank + index for index in range(count)]

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Topology:
        """Read and validate the contract; every error names the variable at fault."""

        layout = layout_from_env(environ)
        try:
            topology = cls(
                cluster=environ.get("TESSERA_CLUSTER", "local"),
                namespace=environ.get("TESSERA_NAMESPACE", "default"),
                group=read_int(environ, "TESSERA_GROUP", 0),
                layout=layout or ParallelLayout(),
                tp_rank=read_int(environ, "TESSERA_TP_RANK", 0),
                pp_rank=read_int(environ, "TESSERA_PP_RANK", 0),
                leader_addr=environ.get("TESSERA_LEADER_ADDR", environ.get("MASTER_ADDR", "127.0.0.1")),
                dist_port=read_int(environ, "TESSERA_DIST_PORT", DEFAULT_DIST_PORT),
                rpc_port=read_int(environ, "TESSERA_RPC_PORT", DEFAULT_RPC_PORT),
                api_port=read_int(environ, "TESSERA_API_PORT", DEFAULT_API_PORT),
            )
        except ValidationError as exc:
            raise TopologyError(_first_error(exc)) from exc
        if "TESSERA_RANK" in environ and read_int(environ, "TESSERA_RANK", 0) != topology.rank:
            raise TopologyError(
                f"TESSERA_RANK={environ['TESSERA_RANK']} disagrees with "
                f"TESSERA_PP_RANK * TESSERA_TP_SIZE + TESSERA_TP_RANK = {topology.rank}"
            )
        if (
            "TESSERA_WORLD_SIZE" in environ
            and read_int(environ, "TESSERA_WORLD_SIZE", 0) != topology.world_size
        ):
            raise TopologyError(
                f"TESSERA_WORLD_SIZE={environ['TESSERA_WORLD_SIZE']} disagrees with "
                f"TESSERA_TP_SIZE * TESSERA_PP_SIZE = {topology.world_size}"
            )
        return topology


def read_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise TopologyError(f"{name} must be an integer, got {raw!r}") from exc


def read_bool(environ: Mapping[str, str], name: str) -> bool:
    raw = environ.get(name, "false").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off", ""):
        return False
    raise TopologyError(f"{name} must be true or false, got {raw!r}")


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    message = str(first.get("ctx", {}).get("error", first["msg"]))
    for field_name, variable in LAYOUT_ENV.items():
        message = message.replace(field_name, variable)
    return message


def layout_from_env(environ: Mapping[str, str]) -> ParallelLayout | None:
    """The parallel layout the operator wrote, or None when the environment names none."""
    if not any(environ.get(variable) for variable in LAYOUT_ENV.values()):
        return None
    try:
        return ParallelLayout(
            tensor_parallel_size=read_int(environ, "TESSERA_TP_SIZE", 1),
            pipeline_parallel_size=read_int(environ, "TESSERA_PP_SIZE", 1),
            sequence_parallel=read_bool(environ, "TESSERA_SEQUENCE_PARALLEL"),
            layer_partition=parse_partition(environ.get("TESSERA_LAYER_PARTITION")),
            enable_expert_parallel=read_bool(environ, "TESSERA_EXPERT_PARALLEL"),
        )
    except ValidationError as exc:
        raise TopologyError(_first_error(exc)) from exc
