"""CPU GEMM backends for ``x @ weight.T (+ bias)``: a weight reordered once for a library's kernels.

Which library is fastest depends on the CPU (vendor, generation, ISA), the shape and the dtype:
MKL's packed sgemm wins on some Xeons, oneDNN's prepacked blocked layout on others, Tessera's
own panel GEMM (``csrc/panel_gemm.h``, AVX-512 or AVX2) on EPYC Genoa and Milan, its AMX panels
(``csrc/amx_gemm.h``) for bf16 on Xeons with AMX, plain ATen for some shapes. ``gemm_selection``
measures them on the machine; this module only holds the candidates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from tessera.kernels import native_ops

_NO_BIAS = torch.empty(0)


class PackedWeight(ABC):
    """A weight ``[out, in]`` in the form one GEMM backend multiplies fastest."""

    backend: str
    data: torch.Tensor

    @abstractmethod
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, may_pad_rows: bool = False) -> torch.Tensor:
        """``x @ weight.T (+ bias)``. With ``may_pad_rows`` the caller accepts a result whose rows
        lie further apart than their width (a view); backends that gain nothing by it ignore it."""

    def storage(self) -> list[torch.Tensor]:
        """The tensors that hold the weight in this form (what a GEMM call reads besides ``x``)."""
        return [self.data]


class AtenWeight(PackedWeight):
    """The dense weight through ``F.linear``: the reference formulation, and a candidate too."""

    backend = "aten"

    def __init__(self, weight: torch.Tensor) -> None:
        self.data = weight

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, may_pad_rows: bool = False) -> torch.Tensor:
        return F.linear(x, self.data, bias)


class NativePackedWeight(PackedWeight):
    """A weight packed by one of the native kernels' ``*_pack_weight`` functions and multiplied
    by its ``*_linear`` partner (``[M, K] x packed -> [M, N]``, bias fp32 or empty)."""

    pack_function: str
    linear_function: str

    def __init__(self, weight: torch.Tensor, ops: ModuleType) -> None:
        self.out_features = weight.shape[0]
        self.data = getattr(ops, self.pack_function)(weight.contiguous())
        self.kernel: Callable[..., torch.Tensor] = getattr(ops, self.linear_function)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, may_pad_rows: bool = False) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        bias = _NO_BIAS if bias is None else bias
        out = self.kernel(rows, self.data, self.out_features, bias, *self.kernel_flags(may_pad_rows))
        return out.view(*x.shape[:-1], self.out_features)

    def kernel_flags(self, may_pad_rows: bool) -> tuple[bool, ...]:
        """The kernel's arguments after the bias."""
        return ()


class MklPackedWeight(NativePackedWeight):
    """fp32 through MKL's packed GEMM (``cblas_sgemm_pack``/``compute``, via the native kernels);
    the packed copy is larger than the weight (about 1.6x plus ~10 MB)."""

    backend = "mkl"
    pack_function, linear_function = "mkl_pack_weight", "mkl_linear"


class PanelPackedWeight(NativePackedWeight):
    """fp32 or bf16 through Tessera's own GEMM over weight panels (``csrc/panel_gemm.h``: 48
    columns on AVX-512, 16 on AVX2, where bf16 widens to fp32 in registers); the packed copy is the
    weight's size, padded to whole panels."""

    backend = "panels"
    pack_function, linear_function = "panel_pack_weight", "panel_linear"

    def kernel_flags(self, may_pad_rows: bool) -> tuple[bool, ...]:
        # Rows 4 KB apart cost the panels about 10% (csrc/panel_gemm_ops.cpp: multiply_panels).
        return (may_pad_rows,)


class AmxPackedWeight(NativePackedWeight):
    """bf16 through Tessera's AMX GEMM (``csrc/amx_gemm.h``: 32-column panels of AMX B tiles);
    the packed copy is the weight's size, padded to whole panels and to K a multiple of 32."""

    backend = "amx"
    pack_function, linear_function = "amx_pack_weight", "amx_linear"


class GatedPanelWeight:
    """SwiGLU's gate_up weight (``[2W, K]``, gate rows over up rows) in gated panels: each register
    (or AMX) tile holds the gate and the up sums of the same outputs, and the GEMM's epilogue writes
    ``silu(x @ gate.T) * (x @ up.T)`` (``csrc/panel_gemm.h``'s ``GatedRows``, ``csrc/amx_gemm.h``'s),
    so the ``[M, 2W]`` projection is never written out and read back. Rounding matches the unfused
    pass exactly."""

    def __init__(self, weight: torch.Tensor, ops: ModuleType, backend: str = "panels") -> None:
        self.width = weight.shape[0] // 2
        self.backend = backend
        pack, kernel = GATED_KERNELS[backend]
        self.data = getattr(ops, pack)(weight.contiguous())
        self.kernel: Callable[..., torch.Tensor] = getattr(ops, kernel)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return self.kernel(rows, self.data, self.width).view(*x.shape[:-1], self.width)


# The backends whose GEMM takes SwiGLU into its epilogue: their gated pack and multiply functions.
GATED_KERNELS = {
    "panels": ("panel_pack_gated_weight", "panel_linear_silu_mul"),
    "amx": ("amx_pack_gated_weight", "amx_linear_silu_mul"),
}


class OneDnnPackedWeight(PackedWeight):
    """fp32 or bf16 through oneDNN's blocked weight layout (reordered once, as ``to_mkldnn`` does)."""

    backend = "onednn"

    def __init__(self, weight: torch.Tensor) -> None:
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, may_pad_rows: bool = False) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")


class Fp32MklPackedWeight(PackedWeight):
    """A bf16 weight multiplied in fp32 through MKL's packed GEMM: on CPUs without bf16 dot-product
    instructions (no AVX512-BF16 / AMX) bf16 GEMMs run several times slower than fp32 ones, and the
    conversions of the activations cost far less than that. The result is rounded back to bf16."""

    backend = "mkl_fp32"

    def __init__(self, weight: torch.Tensor, ops: ModuleType) -> None:
        self.inner = MklPackedWeight(weight.float(), ops)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, may_pad_rows: bool = False) -> torch.Tensor:
        out = self.inner.matmul(x.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    def storage(self) -> list[torch.Tensor]:
        return self.inner.storage()


@dataclass(frozen=True)
class GemmBackend:
    name: str
    supports: Callable[[torch.Tensor], bool]
    pack: Callable[[torch.Tensor], PackedWeight]


def _mkl_ops(weight: torch.Tensor) -> ModuleType | None:
    ops = native_ops(weight.device)
    return ops if ops is not None and ops.mkl_packed_gemm_available() else None


def _pack_mkl(weight: torch.Tensor) -> PackedWeight:
    ops = _mkl_ops(weight)
    assert ops is not None, "MKL's packed GEMM is unavailable"
    return MklPackedWeight(weight, ops) if weight.dtype == torch.float32 else Fp32MklPackedWeight(weight, ops)


def _onednn_supports(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked linear takes bf16 only where the CPU has bf16 support (AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT): elsewhere reordering the weight raises."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def _panel_ops(weight: torch.Tensor) -> ModuleType | None:
    """The native kernels when their panel GEMM multiplies ``weight``'s dtype here (bf16: even K)."""
    ops = native_ops(weight.device)
    dtype = str(weight.dtype).removeprefix("torch.")
    if ops is None or dtype not in ops.panel_gemm_dtypes():
        return None
    return ops if weight.dtype == torch.float32 or weight.shape[-1] % 2 == 0 else None


def _pack_panels(weight: torch.Tensor) -> PackedWeight:
    ops = _panel_ops(weight)
    assert ops is not None, (
        f"the panel GEMM cannot multiply a {weight.dtype} {tuple(weight.shape)} weight here"
    )
    return PanelPackedWeight(weight, ops)


def _amx_ops(weight: torch.Tensor) -> ModuleType | None:
    """The native kernels when their AMX GEMM multiplies ``weight`` here (bf16 on a CPU with AMX)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    ops = native_ops(weight.device)
    return ops if ops is not None and ops.amx_gemm_available() else None


def _pack_amx(weight: torch.Tensor) -> PackedWeight:
    ops = _amx_ops(weight)
    assert ops is not None, f"the AMX GEMM cannot multiply a {weight.dtype} weight here"
    return AmxPackedWeight(weight, ops)


def pack_gated_panels(weight: torch.Tensor, backend: str = "panels") -> GatedPanelWeight:
    """A SwiGLU gate_up weight in the gated panels of ``backend`` (one of GATED_KERNELS, where it
    multiplies the weight)."""
    ops = native_ops(weight.device)
    assert ops is not None and BACKENDS[backend].supports(weight), (
        f"{backend} cannot multiply a {weight.dtype} {tuple(weight.shape)} weight here"
    )
    return GatedPanelWeight(weight, ops, backend)


BACKENDS: dict[str, GemmBackend] = {
    backend.name: backend
    for backend in (
        GemmBackend("aten", lambda w: True, AtenWeight),
        GemmBackend(
            "mkl",
            lambda w: w.device.type == "cpu" and w.dtype == torch.float32 and _mkl_ops(w) is not None,
            _pack_mkl,
        ),
        GemmBackend(
            "mkl_fp32",
            lambda w: w.device.type == "cpu" and w.dtype == torch.bfloat16 and _mkl_ops(w) is not None,
            _pack_mkl,
        ),
        GemmBackend("onednn", _onednn_supports, OneDnnPackedWeight),
        GemmBackend("panels", lambda w: w.device.type == "cpu" and _panel_ops(w) is not None, _pack_panels),
        GemmBackend("amx", lambda w: _amx_ops(w) is not None, _pack_amx),
    )
}


def candidates(weight: torch.Tensor) -> list[GemmBackend]:
    """The backends that can multiply ``weight`` on this machine (ATen always can)."""
    return [backend for backend in BACKENDS.values() if backend.supports(weight)]


class SwiGLUProduct(PackedWeight):
    """SwiGLU's gate_up weight (``[2W, K]``) as its layer multiplies it, ``[M, K] -> [M, W]``: the
    backend's gated kernel where it has one (``GATED_KERNELS``), else its plain product followed by
    ``activation``. What the GEMM selection times for such a layer: the plain product's time alone
    misses the ``[M, 2W]`` intermediate that only the unfused path writes and reads back."""

    def __init__(
        self,
        backend: str,
        weight: torch.Tensor,
        activation: Callable[[torch.Tensor], torch.Tensor],
        fused: bool = True,
    ) -> None:
        """``fused=False``: the plain product and the activation even where a gated kernel exists."""
        self.backend = backend
        self.activation = activation
        self.gated = pack_gated_panels(weight, backend) if fused and backend in GATED_KERNELS else None
        self.plain = BACKENDS[backend].pack(weight) if self.gated is None else None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, may_pad_rows: bool = False) -> torch.Tensor:
        if self.gated is not None:
            assert bias is None, "the gated kernels take no bias"
            return self.gated.silu_and_mul(x)
        assert self.plain is not None
        return self.activation(self.plain.matmul(x, bias))

    def storage(self) -> list[torch.Tensor]:
        if self.gated is not None:
            return [self.gated.data]
        assert self.plain is not None
        return self.plain.storage()
