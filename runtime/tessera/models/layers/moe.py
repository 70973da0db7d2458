"""A mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token.

Routing follows transformers (Mixtral, Qwen2-MoE, Qwen3-MoE): logits in the model's dtype, a
softmax in fp32, the top k, renormalised to sum to one where the family says so. The experts
then run only on the rows routed to them, grouped: the (token, expert) pairs are sorted by
expert, each expert multiplies its rows in one gate_up and one down GEMM, and the weighted
outputs are added back to their tokens in expert order (transformers' order of additions).

Parallelism. Without expert parallelism each expert's intermediate dimension splits over the TP
ranks like a dense MLP's (column- then row-parallel, partial sums reduced once, a reduce-scatter
under sequence parallelism). With it (``placement.shards_experts``) each rank holds whole
experts, a contiguous range, and tokens travel to them (``expert_parallel.py``). A shared expert
(Qwen2-MoE) stays TP-split in both cases; its partial sums join the routed experts' reduction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.distributed.communication import (
    pad_rows,
    padded_rows,
    tp_all_gather,
    tp_all_reduce,
    tp_reduce_scatter,
)
from tessera.kernels.gemm import AtenWeight, PackedWeight
from tessera.kernels.gemm_selection import select_swiglu_product
from tessera.models.checkpoint import CheckpointTensor
from tessera.models.layers.activation import silu_and_mul
from tessera.models.layers.expert_parallel import compute_on_expert_ranks
from tessera.models.layers.linear import (
    RowParallelLinear,
    SiluGatedLinear,
    _copy_shard,
    _param,
    pack_weight,
)
from tessera.models.layers.moe_timers import MOE_TIMERS
from tessera.topology import RankPlacement

# Rows per expert the GEMM selection times: an expert sees tokens * top_k / num_experts rows, a
# few at decode, some hundred in a prefill chunk. The selection measures every backend, ATen's
# F.linear included, per shape on this machine and keeps the fastest (never a fixed choice).
# Packing per expert pays off here: on the shared 2-core EPYC of this work (fp32, 2 threads,
# other processes running), one expert's gate_up + SwiGLU + down, chosen form vs F.linear:
# hidden 64 / intermediate 32 (the tests'): 11.6 vs 11.5 us at 2 rows, 14.4 vs 15.0 at 16, 160
# vs 422 at 128; hidden 1024 / intermediate 512: 0.10 vs 1.25 ms at 2 rows, 0.72 vs 3.1 at 16,
# 11 vs 24 at 128 (the panels won both products of the larger shape).
EXPERT_ROWS = (2, 16, 128)


@dataclass(frozen=True)
class MoeSpec:
    """What a family's config says about its sparse MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # top-k weights rescaled to sum to one
    # Mixtral multiplies expert outputs by the fp32 weights; Qwen casts them to the model's dtype first.
    weights_in_model_dtype: bool
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    intermediate_field: str = "moe_intermediate_size"  # config.json's name for intermediate_size


class ReplicatedGate(nn.Module):
    """A small gate, whole on every rank. Plain F.linear on purpose, never repacked: a top-k choice
    at a near-tie flips with the summation order, and this [tokens, experts] product is a sliver
    of the layer."""

    def __init__(self, hidden: int, outputs: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param((outputs, hidden), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Router(ReplicatedGate):
    def __init__(self, hidden: int, spec: MoeSpec, dtype: torch.dtype) -> None:
        super().__init__(hidden, spec.num_experts, dtype)
        self.spec = spec

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [n, k], weights [n, k]) per token, as transformers' TopKRouter."""
        probs = torch.softmax(self(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.spec.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return experts, weights


class GroupedExperts(nn.Module):
    """This rank's experts: ``gate_up_proj`` [local experts, 2 * intermediate, hidden] (gate rows
    then up rows) and ``down_proj`` [local experts, hidden, intermediate], transformers' fused
    names. Under EP the local experts are ``[first, first + count)``, whole; otherwise all of
    them, each holding this rank's slice of the intermediate dimension."""

    def __init__(self, hidden: int, spec: MoeSpec, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__()
        self.num_experts = spec.num_experts
        if placement.shards_experts:
            self.count = spec.num_experts // placement.tp_size
            self.first = placement.tp_rank * self.count
            self.shard, self.shards = 0, 1
        else:
            self.count, self.first = spec.num_experts, 0
            self.shard, self.shards = placement.tp_rank, placement.tp_size
        self.intermediate = spec.intermediate_size
        if spec.intermediate_size % self.shards:
            raise ValueError(
                f"config.json {spec.intermediate_field}={spec.intermediate_size} is not divisible by "
                f"tensor_parallel_size={self.shards}: the experts split over the TP ranks "
                "(choose a TP size that divides it, or --enable-expert-parallel to keep experts whole)"
            )
        inter = spec.intermediate_size // self.shards
        self.gate_up_proj = _param((self.count, 2 * inter, hidden), dtype)
        self.down_proj = _param((self.count, hidden, inter), dtype)
        self.gate_up_proj.weight_loader = self._load_fused  # type: ignore[attr-defined]
        self.down_proj.weight_loader = self._load_fused  # type: ignore[attr-defined]
        # Set by pack_weights on CPU: per expert, the fastest forms (gate_up with SwiGLU applied).
        self.packed: list[tuple[PackedWeight, PackedWeight]] | None = None

    def holds(self, expert: int) -> bool:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside the {self.num_experts} config.json describes")
        return self.first <= expert < self.first + self.count

    def parts(self, param: str) -> int:
        """How many per-expert checkpoint tensors fill ``param`` (gate and up; down)."""
        return self.count * (2 if param == "gate_up_proj" else 1)

    def load_expert(self, expert: int, part: str, loaded: torch.Tensor | CheckpointTensor) -> str:
        """One expert's ``gate_proj``/``up_proj``/``down_proj`` checkpoint tensor; returns the parameter it fed."""
        local = expert - self.first
        if part == "down_proj":
            _copy_shard(self.down_proj.data[local], loaded, 1, self.shard, self.intermediate)
            return "down_proj"
        inter = self.gate_up_proj.shape[1] // 2
        dest = self.gate_up_proj.data[local].narrow(0, 0 if part == "gate_proj" else inter, inter)
        _copy_shard(dest, loaded, 0, self.shard, self.intermediate)
        return "gate_up_proj"

    def _load_fused(self, param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor) -> None:
        """A fused checkpoint tensor of every expert ([E, 2I, H] or [E, H, I]): only the local
        experts' rows are read."""
        if loaded.shape[0] != self.num_experts:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} holds not {self.num_experts} experts"
            )
        local = loaded.narrow(0, self.first, self.count)
        if param is self.down_proj:
            _copy_shard(param.data, local, 2, self.shard, self.intermediate)
            return
        inter = param.shape[1] // 2
        for half in range(2):
            source = local.narrow(1, half * self.intermediate, self.intermediate)
            _copy_shard(param.data.narrow(1, half * inter, inter), source, 1, self.shard, self.intermediate)

    def pack_weights(self) -> None:
        """Each expert's weights in the GEMM form measured fastest for its shape (EXPERT_ROWS);
        the dense copies go once no form reads them (ATen's multiplies the dense weight itself)."""
        if self.gate_up_proj.device.type != "cpu":
            return
        self.packed = [
            (
                select_swiglu_product(self.gate_up_proj.data[e], silu_and_mul, EXPERT_ROWS),
                pack_weight(self.down_proj.data[e], EXPERT_ROWS) or AtenWeight(self.down_proj.data[e]),
            )
            for e in range(self.count)
        ]
        for index, param in enumerate((self.gate_up_proj, self.down_proj)):
            if all(forms[index].backend != "aten" for forms in self.packed):
                param.data = torch.empty(0, dtype=param.dtype)

    def expert_forward(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Local expert ``expert``'s SwiGLU MLP on its rows [m, hidden] -> [m, hidden]."""
        if self.packed is not None:
            gate_up, down = self.packed[expert]
            return down.matmul(gate_up.matmul(rows, None), None)
        return F.linear(silu_and_mul(F.linear(rows, self.gate_up_proj[expert])), self.down_proj[expert])

    def grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` sorted by local expert (``counts[e]`` rows each) through their experts, in place order."""
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:  # an expert no token chose does no work
                out[start : start + count] = self.expert_forward(expert, rows[start : start + count])
                start += count
        return out


def combine(
    out: torch.Tensor, tokens: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Add each pair's expert output, weighted, to its token's row (pairs in expert order)."""
    return out.index_add_(0, tokens, (outputs * weights[:, None]).to(out.dtype))


def routed_experts(
    x: torch.Tensor, experts: GroupedExperts, expert_ids: torch.Tensor, weights: torch.Tensor, exchange: bool
) -> torch.Tensor:
    """Every routed (token, expert) pair of ``x``'s rows, summed per token: a partial sum over the
    intermediate slices when the experts are TP-split; with ``exchange`` (EP) the complete sum,
    each pair computed on its expert's rank."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // expert_ids.shape[1]
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    rows = x[tokens]
    if exchange:
        outputs = compute_on_expert_ranks(rows, counts, experts)
    else:
        outputs = MOE_TIMERS.run("experts", experts.grouped, rows, counts)
    return combine(torch.zeros_like(x), tokens, outputs, weights.reshape(-1)[order])


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert, split over the TP ranks as a dense MLP. It neither gathers
    nor reduces: the MoE block does both once, for the routed experts' rows too."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__()
        local = replace(placement, sequence_parallel=False)  # the block gathers the token shards
        self.gate_up_proj = SiluGatedLinear(
            hidden, [intermediate, intermediate], params_dtype=dtype, placement=local
        )
        self.down_proj = RowParallelLinear(
            intermediate, hidden, reduce_results=False, params_dtype=dtype, placement=local
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: rows in and out as a dense MLP's (all tokens, or with sequence
    parallelism this rank's shard)."""

    def __init__(self, config: Any, spec: MoeSpec, dtype: torch.dtype, placement: RankPlacement) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported (silu is)")
        hidden = config.hidden_size
        self.tp_rank, self.tp_size = placement.tp_rank, placement.tp_size
        self.sharded, self.expert_parallel = placement.shards_tokens, placement.shards_experts
        self.gate = Router(hidden, spec, dtype)
        self.experts = GroupedExperts(hidden, spec, dtype, placement)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: ReplicatedGate | None = None
        if spec.shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden, spec.shared_intermediate_size, dtype, placement)
            self.shared_expert_gate = ReplicatedGate(hidden, 1, dtype)

    def shared(self, full: torch.Tensor) -> torch.Tensor:
        """The shared expert's (TP-partial) output, gated per token by a sigmoid, as transformers."""
        assert self.shared_expert is not None and self.shared_expert_gate is not None
        return torch.sigmoid(self.shared_expert_gate(full)) * self.shared_expert(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel:
            return self._expert_parallel_forward(x)
        full = tp_all_gather(x, dim=0) if self.sharded else x
        y = routed_experts(
            full, self.experts, *MOE_TIMERS.run("routing", self.gate.route, full), exchange=False
        )
        if self.shared_expert is not None:
            y = y + self.shared(full)
        if self.tp_size == 1:
            return y
        return tp_reduce_scatter(y, dim=0) if self.sharded else tp_all_reduce(y)

    def _expert_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank routes its own shard of the tokens (its SP shard, or its slice of the
        replicated rows) and exchanges rows with the experts' ranks; then the outputs are
        replicated (or stay sharded) as the next layer expects."""
        if self.sharded:
            shard = x
        else:
            rows = padded_rows(x.shape[0], self.tp_size) // self.tp_size
            shard = pad_rows(x, rows * self.tp_size)[self.tp_rank * rows : (self.tp_rank + 1) * rows]
        y = routed_experts(
            shard, self.experts, *MOE_TIMERS.run("routing", self.gate.route, shard), exchange=True
        )
        if self.shared_expert is None:
            return y if self.sharded else tp_all_gather(y, dim=0)[: x.shape[0]]
        if self.sharded:
            return y + tp_reduce_scatter(self.shared(tp_all_gather(x, dim=0)), dim=0)
        # One all-reduce replicates the routed rows and sums the shared expert's partials.
        total = pad_rows(self.shared(x), rows * self.tp_size)
        total[self.tp_rank * rows : (self.tp_rank + 1) * rows] += y
        return tp_all_reduce(total)[: x.shape[0]]
