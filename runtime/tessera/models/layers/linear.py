"""Linear layers written for tensor parallelism (Megatron-style), with per-parameter weight loaders.

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` that copies
this rank's slice of a full checkpoint tensor into it, so the loader streams checkpoint
tensors one by one without knowing how each layer is sharded. Each layer is built from its
rank's ``RankPlacement`` (tessera.topology). With one tensor-parallel rank every
slice is the whole tensor and the layers are plain ``F.linear``.

On CPU, ``process_weights_after_loading`` puts every weight once in the form of the GEMM
backend measured fastest for its shape on this machine (MKL packed, oneDNN prepacked, Tessera's
AVX-512 panels or ATen's ``F.linear``; see ``tessera.kernels.gemm_selection``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

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
from tessera.kernels.gemm import AtenWeight, GatedPanelWeight, PackedWeight
from tessera.kernels.gemm_selection import LAYER_ROWS, select_backend, select_swiglu_product
from tessera.models.checkpoint import CheckpointTensor, materialize
from tessera.models.layers.activation import gelu_tanh_and_mul, silu_and_mul
from tessera.topology import SINGLE_RANK, RankPlacement

logger = logging.getLogger(__name__)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def _param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by the checkpoint.
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def pack_weight(weight: torch.Tensor, rows: tuple[int, ...] = LAYER_ROWS) -> PackedWeight | None:
    """``weight`` in the fastest GEMM backend's form on this machine (measured once per shape and
    recorded, see ``gemm_selection``), or None off CPU, where ``F.linear`` is the kernel."""
    if weight.device.type != "cpu":
        return None
    return select_backend(weight, rows)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: PackedWeight | None,
    bias: torch.Tensor | None,
    may_pad_rows: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, through the packed form when there is one (``may_pad_rows``:
    see ``PackedWeight.matmul``)."""
    if packed is not None:
        return packed.matmul(x, bias, may_pad_rows)
    return F.linear(x, weight, bias)


@runtime_checkable
class PacksWeights(Protocol):
    """A layer that puts its weights in their fastest GEMM form once loaded: every linear layer
    and the LM head (embedding.py), which this module does not import (embedding imports it)."""

    def pack_weights(self) -> None: ...


class LinearBase(nn.Module):
    """What every linear layer shares: a weight ``[out, in]`` and, on CPU, its packed form."""

    weight: nn.Parameter
    packed_weight: PackedWeight | None

    def __init__(self) -> None:
        super().__init__()
        self.packed_weight = None  # set by process_weights_after_loading

    def create_weights(
        self,
        weight_shape: tuple[int, int],
        bias_size: int | None,
        dtype: torch.dtype | None,
        bias_loader: Callable[[nn.Parameter, torch.Tensor], None] | None = None,
    ) -> None:
        """This rank's weight (and bias, when ``bias_size`` is given), each tagged with the loader
        that copies its slice of a checkpoint tensor: ``weight_loader``, or ``bias_loader`` for the bias."""
        self.weight = _param(weight_shape, dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = None if bias_size is None else _param((bias_size,), dtype)
        if self.bias is not None:
            self.bias.weight_loader = bias_loader or self.weight_loader  # type: ignore[attr-defined]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, self.weight, self.packed_weight, bias)

    def pack_weights(self) -> None:
        """The weight in its fastest GEMM form here (see ``pack_weight``)."""
        self.use_packed(pack_weight(self.weight.data))

    def use_packed(self, packed: PackedWeight | None) -> None:
        """Multiply through ``packed`` from now on; the dense copy goes when a packed one replaces it."""
        self.packed_weight = packed
        if packed is not None and not isinstance(packed, AtenWeight):
            self.release_dense_weight()

    def release_dense_weight(self) -> None:
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor | CheckpointTensor) -> None:
    """Copy a checkpoint tensor of exactly the parameter's shape (copy_ would broadcast)."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}"
        )
    param.copy_(materialize(loaded))


def _copy_shard(
    dest: torch.Tensor, loaded: torch.Tensor | CheckpointTensor, dim: int, index: int, whole: int
) -> None:
    """Copy shard ``index`` along ``dim`` of a checkpoint tensor that holds ``whole`` entries there
    (what config.json implies): checked before cutting, so a larger tensor (another model's
    layer) is refused, never cut to fit."""
    expected = (*dest.shape[:dim], whole, *dest.shape[dim + 1 :])
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {expected}")
    size = dest.shape[dim]
    copy_checked(dest, loaded.narrow(dim, index * size, size))


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.create_weights((output_size, input_size), output_size if bias else None, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by output columns: rank r holds rows [r*out/tp, (r+1)*out/tp) of the weight."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        placement: RankPlacement = SINGLE_RANK,
        output_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = placement.tp_rank, placement.tp_size
        # Sequence parallelism: the input arrives sharded over tokens and is gathered here.
        self.gather_input = placement.shards_tokens
        self.input_size = input_size
        self.output_sizes = output_sizes or [output_size]
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.gather_output = gather_output
        shard = self.output_size_per_partition
        self.create_weights((shard, input_size), shard if bias else None, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy_shard(param.data, loaded, 0, self.tp_rank, param.shape[0] * self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            x = tp_all_gather(x, dim=0)
        y = self.matmul(x, self.bias)
        return tp_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and up).

    Rank r's weight is the concatenation of rank r's slice of each projection, so the fused
    output splits locally into per-projection pieces without communication.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        placement: RankPlacement = SINGLE_RANK,
    ) -> None:
        for size in output_sizes:
            divide(size, placement.tp_size)
        super().__init__(
            input_size,
            sum(output_sizes),
            bias=bias,
            params_dtype=params_dtype,
            placement=placement,
            output_sizes=output_sizes,
        )

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int
    ) -> None:
        shard = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy_shard(param.data.narrow(0, offset, shard), loaded, 0, self.tp_rank, self.output_sizes[shard_id])


class SiluGatedLinear(MergedColumnParallelLinear):
    """SwiGLU's gate and up projections (``output_sizes``: [intermediate, intermediate]) with the
    activation applied: ``silu(x @ gate.T) * (x @ up.T)``.

    Where the panel or the AMX GEMM is this weight's fastest backend (and there is no bias), the
    activation runs in the GEMM's epilogue (``GatedPanelWeight``): the ``[tokens, 2 * intermediate]``
    projection is never written out and read back. On a 2-core EPYC Turin this made the fp32
    gate_up + activation of a 2048-token prefill chunk 17% faster (30 layers: 511 -> 436 ms), 5% at
    512 tokens, level at decode sizes; bf16 2% at 2048 tokens. So the backend is chosen by timing
    each candidate as this layer runs it (``select_swiglu_product``), the gated kernels with their
    epilogue and the others followed by the activation: timed on the plain products alone, a
    backend that wins the product by less than the activation pass costs would be chosen, and
    the layer would run slower.
    """

    # Set by pack_weights where the panels (or AMX panels) multiply this weight.
    gated_weight: GatedPanelWeight | None = None

    def pack_weights(self) -> None:
        weight = self.weight.data
        if weight.device.type != "cpu" or self.bias is not None:
            super().pack_weights()  # the gated kernels take no bias: the plain product's verdict
            return
        product = select_swiglu_product(weight, silu_and_mul)
        if product.gated is not None:
            # Gated panels in place of plain ones: this layer only ever multiplies for SwiGLU.
            self.gated_weight = product.gated
            self.release_dense_weight()
        else:
            self.use_packed(product.plain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            x = tp_all_gather(x, dim=0)
        if self.gated_weight is not None:
            return self.gated_weight.silu_and_mul(x)
        return silu_and_mul(self.matmul(x, self.bias))


class GeluTanhGatedLinear(MergedColumnParallelLinear):
    """GeGLU's gate and up projections (``output_sizes``: [intermediate, intermediate]) with the
    activation applied: ``gelu_tanh(x @ gate.T) * (x @ up.T)`` (Gemma). No GEMM kernel has it in
    its epilogue: the plain (packed) product, then the activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(super().forward(x))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused, split by heads.

    Query heads split evenly over ranks. KV heads split too when there are at least as many
    as ranks; otherwise each KV head is replicated on ``tp_size / num_kv_heads`` consecutive
    ranks (the ranks whose query heads share it under GQA).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        placement: RankPlacement = SINGLE_RANK,
    ) -> None:
        self.head_dim = head_dim
        tp_size = placement.tp_size
        if total_num_heads % tp_size:
            raise ValueError(
                f"{total_num_heads} attention heads do not split over tensor_parallel_size={tp_size}: "
                "choose a tensor-parallel size that divides the number of query heads"
            )
        self.num_heads = total_num_heads // tp_size
        if tp_size % total_num_kv_heads and total_num_kv_heads % tp_size:
            raise ValueError(
                f"{total_num_kv_heads} key/value heads do not split over tensor_parallel_size={tp_size}: "
                "choose a tensor-parallel size that divides the number of key/value heads, or a multiple of it"
            )
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads  # each KV head on several ranks
        else:
            self.num_kv_heads = total_num_kv_heads // tp_size
            self.num_kv_head_replicas = 1
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            (q_size + 2 * kv_size) * tp_size,
            bias=bias,
            params_dtype=params_dtype,
            placement=placement,
        )
        self.q_size, self.kv_size = q_size, kv_size
        self.total_q_size, self.total_kv_size = total_num_heads * head_dim, total_num_kv_heads * head_dim

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str
    ) -> None:
        if shard_id == "q":
            dest = param.data.narrow(0, 0, self.q_size)
            _copy_shard(dest, loaded, 0, self.tp_rank, self.total_q_size)
        elif shard_id in ("k", "v"):
            dest = param.data.narrow(0, self.q_size + (self.kv_size if shard_id == "v" else 0), self.kv_size)
            _copy_shard(dest, loaded, 0, self.tp_rank // self.num_kv_head_replicas, self.total_kv_size)
        else:
            raise ValueError(f"unknown QKV shard {shard_id!r}")


class RowParallelLinear(LinearBase):
    """Y = X A with A split by input rows; partial products are summed over the TP group.

    The bias is added once, after the reduction, so it is not counted tp_size times. With
    sequence parallelism the sum is a reduce-scatter over tokens (rows padded to a multiple of
    the TP size): each rank keeps only its shard of the output.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
        placement: RankPlacement = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = placement.tp_rank, placement.tp_size
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.reduce_results = reduce_results
        self.scatter_output = placement.shards_tokens
        # The bias is whole on every rank (added once, after the reduction).
        self.create_weights(
            (output_size, self.input_size_per_partition),
            output_size if bias else None,
            params_dtype,
            bias_loader=self._load_bias,
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy_shard(param.data, loaded, 1, self.tp_rank, param.shape[1] * self.tp_size)

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        y = self.matmul(x, None)
        if self.scatter_output:
            y = tp_reduce_scatter(pad_rows(y, padded_rows(y.shape[0], self.tp_size)), dim=0)
        elif self.reduce_results:
            y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y


def process_weights_after_loading(model: nn.Module) -> None:
    """Repack CPU matmul weights once loaded (see ``pack_weight``).

    A linear layer's dense copy is released when a packed form replaces it; the LM head keeps its own, which the (tied)
    embedding looks rows up in.
    """
    backends: dict[str, set[str]] = {}  # layer name (last part) -> the backends its weights run on
    for name, module in model.named_modules():
        if not isinstance(module, PacksWeights):
            continue
        module.pack_weights()
        backend = gemm_backend(module)
        if backend is not None:
            backends.setdefault(name.rpartition(".")[2] or type(module).__name__, set()).add(backend)
    if backends:  # what a pod's log should say about its kernels (`tessera kernels`: the scores)
        logger.info(
            "GEMM backends: %s",
            "; ".join(f"{layer} {', '.join(sorted(names))}" for layer, names in backends.items()),
        )


def gemm_backend(module: object) -> str | None:
    """The GEMM backend a packed layer multiplies with (``gated`` with SwiGLU in its epilogue),
    None where ``F.linear`` on the dense weight is the kernel (off CPU)."""
    gated = getattr(module, "gated_weight", None)
    if isinstance(gated, GatedPanelWeight):
        return f"gated {gated.backend}"
    packed = getattr(module, "packed_weight", None)
    return packed.backend if isinstance(packed, PackedWeight) else None
