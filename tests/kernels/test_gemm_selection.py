"""GEMM backend selection: every backend multiplies like ``F.linear``, whichever one wins on the
machine running the tests, and a verdict is measured once per shape, recorded and reused."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels import gemm_selection, native_ops
from tessera.kernels.gemm import (
    BACKENDS,
    GATED_KERNELS,
    AtenWeight,
    PackedWeight,
    SwiGLUProduct,
    candidates,
    pack_gated_panels,
)
from tessera.models.layers.activation import silu_and_mul
from tessera.models.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    SiluGatedLinear,
    pack_weight,
    process_weights_after_loading,
)
from tessera.topology import RankPlacement

torch.set_num_threads(2)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
CONTENTION_LIMIT_CPUS = gemm_selection.CONTENTION_LIMIT_CPUS  # before the fixture lifts it


def backend_names(dtype: torch.dtype) -> list[str]:
    return [backend.name for backend in candidates(torch.empty(1, 2, dtype=dtype))]  # bf16 panels: even K


CASES = [(name, dtype) for dtype in TOLERANCE for name in backend_names(dtype)]


@pytest.mark.parametrize(("backend", "dtype"), CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
@pytest.mark.parametrize("rows", [1, 13, 300])
def test_every_backend_multiplies_like_f_linear(backend: str, dtype: torch.dtype, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(rows, 80, generator=generator).to(dtype)
    packed = BACKENDS[backend].pack(weight)
    tolerance = TOLERANCE[dtype]
    for with_bias in (None, bias):
        expected = F.linear(x.float(), weight.float(), None if with_bias is None else bias.float())
        got = packed.matmul(x, with_bias)
        assert got.dtype == dtype and got.shape == (rows, 96)
        torch.testing.assert_close(got.float(), expected, atol=tolerance * 10, rtol=tolerance)


PANEL_DTYPES = [dtype for dtype in TOLERANCE if "panels" in backend_names(dtype)]
# The backends that take SwiGLU into their GEMM's epilogue, with each dtype they multiply here.
GATED_CASES = [(name, dtype) for dtype in TOLERANCE for name in GATED_KERNELS if name in backend_names(dtype)]
AMX = "amx" in backend_names(torch.bfloat16)


@pytest.mark.parametrize("dtype", PANEL_DTYPES, ids=[str(d)[6:] for d in PANEL_DTYPES])
def test_panel_gemm_covers_short_panels_partial_tiles_and_strided_inputs(dtype: torch.dtype) -> None:
    """Output widths that leave the last panel short (48 columns on AVX-512: 1, 2, 17 or 47 short;
    16 on AVX2: 1, 2, 14 or 15), row counts around the 8- and 6-row tiles, an input wide enough
    to be multiplied in several blocks of rows, and an input that is a non-contiguous view."""
    generator = torch.Generator().manual_seed(0)
    shapes = ((1, 6), (47, 64), (50, 80), (97, 64), (143, 32), (96, 2), (50, 4096))
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        packed = BACKENDS["panels"].pack(weight)
        columns = packed.data.shape[1] // in_features
        assert columns in (16, 48) and packed.data.shape == (
            -(-out_features // columns),
            in_features * columns,
        )
        for rows in (1, 5, 6, 7, 8, 9, 16, 17, 65):
            x = torch.randn(in_features, rows, generator=generator).to(dtype).t()  # a transposed view
            for with_bias in (None, bias):
                expected = F.linear(x.float(), weight.float(), None if with_bias is None else bias.float())
                got = packed.matmul(x, with_bias)
                assert got.dtype == dtype and got.shape == (rows, out_features)
                torch.testing.assert_close(
                    got.float(), expected, atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype]
                )
                # A row's sums do not depend on the rows beside it or the tile it falls in:
                # batching never changes a token.
                assert torch.equal(got[-1:], packed.matmul(x[-1:], with_bias))


@pytest.mark.parametrize("dtype", PANEL_DTYPES, ids=[str(d)[6:] for d in PANEL_DTYPES])
def test_panel_outputs_4k_apart_may_come_back_with_padded_rows(dtype: torch.dtype) -> None:
    """Where the caller allows it (the LM head), outputs whose rows would be a multiple of 4 KB
    apart come back as a view with padded rows: the same values, and the sampler reads them."""
    from tessera.worker.sampler import greedy

    generator = torch.Generator().manual_seed(0)
    width = 4096 // torch.empty((), dtype=dtype).element_size()
    for out_features, padded in ((width, True), (2 * width, True), (width + 48, False)):
        weight = torch.randn(out_features, 64, generator=generator).to(dtype)
        packed = BACKENDS["panels"].pack(weight)
        for rows in (1, 9, 64):
            x = torch.randn(rows, 64, generator=generator).to(dtype)
            dense = packed.matmul(x, None)
            got = packed.matmul(x, None, may_pad_rows=True)
            assert dense.is_contiguous() and got.shape == dense.shape
            assert (got.stride(0) > out_features) == (padded and rows > 1)
            assert torch.equal(got, dense)
            assert torch.equal(greedy(got), greedy(dense))


def swiglu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) in fp32 for a gate_up weight [2W, K]."""
    gate, up = weight.float().chunk(2)
    return F.silu(F.linear(x.float(), gate)) * F.linear(x.float(), up)


@pytest.mark.parametrize(("backend", "dtype"), GATED_CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in GATED_CASES])
def test_gated_panels_give_the_unfused_swiglu_bit_for_bit(backend: str, dtype: torch.dtype) -> None:
    """The activation in the GEMM's epilogue: widths around the gated panels' outputs (24 on
    AVX-512, 8 on AVX2, 16 on AMX), so the last panel is short by 1 or most of its columns; row
    counts around the tiles. The result equals the backend's plain panels followed by the
    activation pass exactly (the factors are rounded to the dtype first, as that pass reads
    them), and the fp32 reference within tolerance."""
    generator = torch.Generator().manual_seed(0)
    plain = BACKENDS[backend]
    for width in (1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 40, 100):
        for in_features in (6, 64):
            weight = (torch.randn(2 * width, in_features, generator=generator) * 2).to(dtype)
            gated, unfused = pack_gated_panels(weight, backend), plain.pack(weight)
            for rows in (1, 5, 8, 9, 17, 33, 65, 300):
                x = torch.randn(rows, in_features, generator=generator).to(dtype)
                got = gated.silu_and_mul(x)
                assert got.dtype == dtype and got.shape == (rows, width)
                assert torch.equal(got, silu_and_mul(unfused.matmul(x, None)))
                torch.testing.assert_close(
                    got.float(),
                    swiglu_reference(x, weight),
                    atol=TOLERANCE[dtype] * 10,
                    rtol=TOLERANCE[dtype],
                )
                assert torch.equal(got[-1:], gated.silu_and_mul(x[-1:]))


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX (or the kernels were built without it)")
def test_amx_gemm_covers_short_panels_padded_inputs_row_tiles_and_blocks() -> None:
    """Output widths that leave the last 32-column panel short, input widths that are not whole
    32-input steps (padded with zeros), row counts around the 16-row tiles and 32-row pairs, and
    inputs tall enough for several blocks of rows (224 rows at 576 inputs); a transposed view as
    input. Every row's sums are its own: batching never changes a token."""
    generator = torch.Generator().manual_seed(0)
    shapes = ((1, 6), (31, 64), (33, 80), (49, 32), (100, 576), (64, 7), (50, 1536))
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
        bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
        packed = BACKENDS["amx"].pack(weight)
        assert packed.data.shape == (-(-out_features // 32), -(-in_features // 32) * 32 * 32)
        for rows in (1, 15, 16, 17, 31, 32, 33, 48, 64, 65, 500):
            x = torch.randn(in_features, rows, generator=generator).to(torch.bfloat16).t()
            for with_bias in (None, bias):
                expected = F.linear(x.float(), weight.float(), None if with_bias is None else bias.float())
                got = packed.matmul(x, with_bias)
                assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
                torch.testing.assert_close(got.float(), expected, atol=0.2, rtol=2e-2)
                assert torch.equal(got[-1:], packed.matmul(x[-1:], with_bias))
                assert torch.equal(got[:1], packed.matmul(x[:1], with_bias))


def test_amx_gemm_is_a_candidate_exactly_where_the_cpu_has_amx() -> None:
    """AMX panels multiply bf16 only, and only where the kernels were built with AMX and Linux
    granted the tile state; fp32 never goes through them."""
    from tessera.kernels import cpu_kernels

    ops = cpu_kernels()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert (ops is not None and ops.amx_gemm_available()) == AMX
    if AMX:
        assert "amx_bf16" in flags
    assert "amx" not in backend_names(torch.float32)


@pytest.mark.parametrize(("backend", "dtype"), CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_silu_gated_layer_matches_aten_on_every_backend(
    backend: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SwiGLU's gate_up layer, a tensor-parallel shard of it, on each backend: the panels (and
    the AMX panels) take the activation into their epilogue (without a bias), every other backend
    runs it after."""
    monkeypatch.setenv(gemm_selection.FORCE_VARIABLE, backend)
    x = torch.randn(9, 64).to(dtype)
    for bias in (False, True):
        layer = SiluGatedLinear(
            64, [40, 40], bias=bias, params_dtype=dtype, placement=RankPlacement(tp_rank=1, tp_size=2)
        )
        for param in layer.parameters():
            param.data.normal_()
        gate_up = F.linear(
            x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float()
        )
        expected = silu_and_mul(gate_up)
        process_weights_after_loading(layer)
        fused = backend in GATED_KERNELS and not bias
        assert (layer.gated_weight is not None) == fused
        assert (layer.packed_weight is None) == fused
        got = layer(x)
        assert got.shape == (9, 20)
        torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype])


def test_swiglu_weights_are_selected_as_their_layer_runs_them(selection_file: Path) -> None:
    """gate_up's candidates are timed as SiluGatedLinear runs them (the gated kernels with SwiGLU in
    their epilogue, every other backend followed by the activation pass), under a key of their
    own; the verdict decides whether the layer runs gated, and every form gives SwiGLU."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(2 * 40, 64, generator=generator)
    x = torch.randn(5, 64, generator=generator)
    expected = swiglu_reference(x, weight)
    _, forms = gemm_selection.measure(weight, (4, 32), silu_and_mul)
    assert set(forms) == {backend.name for backend in candidates(weight)}
    for name, form in forms.items():
        assert isinstance(form, SwiGLUProduct)
        assert (form.gated is not None) == (name in GATED_KERNELS)
        torch.testing.assert_close(form.matmul(x, None), expected, atol=1e-3, rtol=1e-4)
    layer = SiluGatedLinear(64, [40, 40], params_dtype=torch.float32)
    layer.weight.data.copy_(weight)
    process_weights_after_loading(layer)
    key = gemm_selection.selection_key(weight, gemm_selection.LAYER_ROWS, swiglu=True)
    assert ":swiglu:" in key and key != gemm_selection.selection_key(weight, gemm_selection.LAYER_ROWS)
    recorded = json.loads(selection_file.read_text())
    assert set(recorded) == {key}  # the plain product's verdict is never asked for
    assert (layer.gated_weight is not None) == (recorded[key]["backend"] in GATED_KERNELS)
    torch.testing.assert_close(layer(x), expected, atol=1e-3, rtol=1e-4)


def test_a_large_swiglu_weight_is_sampled_from_both_halves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gated kernels pair gate row i with up row W + i: a sample keeps as many of each."""
    monkeypatch.setattr(gemm_selection, "MEASURE_BYTES_LIMIT", 16 << 10)
    weight = torch.randn(512, 48)
    sample = gemm_selection.measure_sample(weight, swiglu=True)
    each = sample.shape[0] // 2
    assert sample.shape == (2 * each, 48) and each == 64
    assert torch.equal(sample[:each], weight[:each]) and torch.equal(sample[each:], weight[256 : 256 + each])
    assert torch.equal(gemm_selection.measure_sample(weight), weight[:64])


def test_panel_gemm_leaves_odd_bf16_widths_to_other_backends() -> None:
    """bf16 panels hold input pairs; a weight with an odd input width is not a candidate."""
    assert "panels" not in {b.name for b in candidates(torch.empty(4, 7, dtype=torch.bfloat16))}


@pytest.mark.parametrize(("backend", "dtype"), CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_forced_backend_serves_sharded_layers_like_aten(
    backend: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor-parallel shards (column: half the outputs, row: half the inputs) on each backend."""
    monkeypatch.setenv(gemm_selection.FORCE_VARIABLE, backend)
    x = torch.randn(7, 80).to(dtype)
    for layer, shard_input in (
        (
            ColumnParallelLinear(
                80, 96, bias=True, params_dtype=dtype, placement=RankPlacement(tp_rank=1, tp_size=2)
            ),
            x,
        ),
        (
            RowParallelLinear(
                80, 96, bias=False, params_dtype=dtype, placement=RankPlacement(tp_rank=1, tp_size=2)
            ),
            x[:, :40],
        ),
    ):
        for param in layer.parameters():
            param.data.normal_()
        expected = F.linear(shard_input, layer.weight, getattr(layer, "bias", None))
        process_weights_after_loading(layer)
        assert layer.packed_weight is not None and layer.packed_weight.backend == backend
        released = layer.weight.numel() == 0
        assert released == (backend != "aten")  # a packed copy replaces the dense one
        got = layer.matmul(shard_input, getattr(layer, "bias", None))
        torch.testing.assert_close(
            got.float(), expected.float(), atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype]
        )


@pytest.mark.parametrize(("backend", "dtype"), CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_every_backend_locates_its_weight_and_multiplies_alike_once_it_is_evicted(
    backend: str, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 80, generator=generator).to(dtype)
    x = torch.randn(5, 80, generator=generator).to(dtype)
    packed = BACKENDS[backend].pack(weight)
    before = packed.matmul(x, None)
    ranges = gemm_selection.memory_ranges(packed)
    # Every packed form holds at least the weight's own bytes (padding and copies only add).
    assert ranges and sum(size for _, size in ranges) >= weight.numel() * weight.element_size()
    assert all(address > 0 for address, _ in ranges)
    assert gemm_selection.evict(packed) is (native_ops(torch.device("cpu")) is not None)
    torch.testing.assert_close(packed.matmul(x, None), before, atol=0, rtol=0)


def test_every_candidate_is_timed_on_an_evicted_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    real_evict = gemm_selection.evict

    def recording_evict(form: PackedWeight) -> bool:
        events.append(("evict", form.backend))
        return real_evict(form)

    def packing(
        name: str, real_pack: Callable[[torch.Tensor], PackedWeight]
    ) -> Callable[[torch.Tensor], PackedWeight]:
        def pack(weight: torch.Tensor) -> PackedWeight:
            form = real_pack(weight)
            real_matmul = form.matmul

            def matmul(
                x: torch.Tensor, bias: torch.Tensor | None, may_pad_rows: bool = False
            ) -> torch.Tensor:
                events.append(("matmul", name))
                return real_matmul(x, bias, may_pad_rows)

            form.matmul = matmul  # type: ignore[method-assign]
            return form

        return pack

    for name, backend in BACKENDS.items():
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(backend, pack=packing(name, backend.pack)))
    monkeypatch.setattr(gemm_selection, "evict", recording_evict)
    weight = torch.randn(64, 48)
    rows = (4, 32)
    gemm_selection.measure(weight, rows)
    names = [backend.name for backend in candidates(weight)]
    evictions = [i for i, (kind, _) in enumerate(events) if kind == "evict"]
    # Each eviction is followed by its own form's timed call, and every call but one warm-up per
    # candidate and row count follows one.
    assert all(events[i + 1] == ("matmul", events[i][1]) for i in evictions)
    assert len(events) - 2 * len(evictions) == len(names) * len(rows)
    for name in names:
        assert events.count(("evict", name)) >= gemm_selection._MIN_ROUNDS * len(rows)


def test_a_tie_goes_to_the_smallest_packed_form_and_a_clear_win_to_the_fastest() -> None:
    sizes = {"mkl": 11_600_000, "panels": 2_200_000, "onednn": 2_300_000, "aten": 2_200_000}
    # MKL ahead by less than SCORE_TIE: a tie, and the panels hold the fewest bytes.
    tie = {"mkl": 1.015, "panels": 1.021, "onednn": 1.29, "aten": 1.23}
    assert gemm_selection.choose(tie, sizes) == "panels"
    # Equal bytes within the tie: the better score.
    assert gemm_selection.choose({**tie, "aten": 1.02}, sizes) == "aten"
    # Beyond the tie, speed wins whatever the bytes.
    assert gemm_selection.choose({**tie, "mkl": 1.0, "panels": 1.03}, sizes) == "mkl"


def test_a_verdict_is_measured_once_recorded_and_reused(
    selection_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = torch.randn(64, 48)
    first = pack_weight(weight, (4, 32))
    assert first is not None
    recorded = json.loads(selection_file.read_text())
    key = gemm_selection.selection_key(weight, (4, 32))
    assert key.startswith(f"float32:64x48:threads={torch.get_num_threads()}:rows=4,32")
    assert recorded[key]["backend"] == first.backend
    scores = recorded[key]["scores"]
    assert (
        set(scores) == set(recorded[key]["packed_bytes"]) == {backend.name for backend in candidates(weight)}
    )
    assert scores[first.backend] <= min(scores.values()) * (1 + gemm_selection.SCORE_TIE)
    assert recorded[key]["backend"] == gemm_selection.choose(scores, recorded[key]["packed_bytes"])

    def no_measuring(*args: object) -> None:
        raise AssertionError("a recorded verdict was measured again")

    monkeypatch.setattr(gemm_selection, "measure", no_measuring)
    again = pack_weight(torch.randn(64, 48), (4, 32))
    assert again is not None and again.backend == first.backend


def test_a_large_weight_is_measured_on_a_sample_and_only_the_winner_packs_it_whole(
    selection_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Scaled down: a 16 KiB limit stands for the real one, so a 256 x 48 fp32 weight is "large".
    monkeypatch.setattr(gemm_selection, "MEASURE_BYTES_LIMIT", 16 << 10)
    weight = torch.randn(256, 48)
    packed_shapes: list[tuple[int, ...]] = []
    for backend in candidates(weight):

        def pack(w: torch.Tensor, original: Any = backend.pack) -> Any:
            packed_shapes.append(tuple(w.shape))
            return original(w)

        monkeypatch.setitem(BACKENDS, backend.name, dataclasses.replace(backend, pack=pack))
    form = pack_weight(weight, (4, 32))
    assert form is not None
    assert packed_shapes.count((64, 48)) == len(candidates(weight))  # every candidate on 64 rows
    assert packed_shapes.count((256, 48)) <= 1  # then the winner (ATen keeps the dense weight)
    torch.testing.assert_close(form.matmul(x := torch.randn(5, 48), None), x @ weight.T, atol=1e-4, rtol=1e-4)
    key = gemm_selection.selection_key(weight, (4, 32))
    assert json.loads(selection_file.read_text())[key]["backend"] == form.backend


def test_a_recorded_verdict_is_honoured_and_others_kept(selection_file: Path) -> None:
    weight = torch.randn(64, 48)
    key = gemm_selection.selection_key(weight, gemm_selection.LAYER_ROWS)
    other = {"backend": "onednn", "scores": {}}
    selection_file.write_text(json.dumps({key: {"backend": "aten", "scores": {}}, "other-shape": other}))
    packed = pack_weight(weight)
    assert isinstance(packed, AtenWeight)
    # A new shape is measured and merged in; verdicts recorded before stay.
    pack_weight(torch.randn(32, 48))
    recorded = json.loads(selection_file.read_text())
    assert recorded["other-shape"] == other and recorded[key]["backend"] == "aten"
    assert gemm_selection.selection_key(torch.randn(32, 48), gemm_selection.LAYER_ROWS) in recorded


def test_a_prebuilt_verdict_serves_unmeasured_where_this_cache_has_none(
    selection_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    baked, own = torch.randn(64, 48), torch.randn(32, 48)
    baked_key, own_key = (gemm_selection.selection_key(w, gemm_selection.LAYER_ROWS) for w in (baked, own))
    prebuilt = gemm_selection.prebuilt_selection_path()
    prebuilt.parent.mkdir(parents=True)
    prebuilt.write_text(json.dumps({key: {"backend": "aten", "scores": {}} for key in (baked_key, own_key)}))
    selection_file.write_text(json.dumps({own_key: {"backend": "onednn", "scores": {}}}))

    def no_measuring(*args: object) -> None:
        raise AssertionError("a verdict the caches hold was measured")

    monkeypatch.setattr(gemm_selection, "measure", no_measuring)
    assert gemm_selection.selected_backend(baked) == "aten"
    assert gemm_selection.selected_backend(own) == "onednn"  # this cache's own verdict wins


def test_shards_are_selected_at_their_own_shapes(selection_file: Path) -> None:
    column = ColumnParallelLinear(80, 96, placement=RankPlacement(tp_rank=0, tp_size=2))
    row = RowParallelLinear(80, 96, placement=RankPlacement(tp_rank=0, tp_size=2))
    for layer in (column, row):
        layer.weight.data.normal_()
        process_weights_after_loading(layer)
    shapes = {key.split(":")[1] for key in json.loads(selection_file.read_text())}
    assert shapes == {"48x80", "96x40"}


def test_an_unsupported_recorded_backend_is_measured_again(selection_file: Path) -> None:
    weight = torch.randn(64, 48, dtype=torch.bfloat16)
    key = gemm_selection.selection_key(weight, gemm_selection.LAYER_ROWS)
    selection_file.write_text(json.dumps({key: {"backend": "mkl", "scores": {}}}))  # mkl has no bf16 GEMM
    packed = pack_weight(weight)
    assert packed is not None and packed.backend != "mkl"
    assert json.loads(selection_file.read_text())[key]["backend"] == packed.backend


def test_an_unknown_forced_backend_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gemm_selection.FORCE_VARIABLE, "blas9000")
    with pytest.raises(ValueError, match=r"TESSERA_GEMM_BACKEND='blas9000'.*aten"):
        pack_weight(torch.randn(8, 8))


MEASURE_IN_PINNED_PROCESS = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from tessera.kernels import gemm_selection
    from tessera.models.layers.linear import pack_weight
    torch.set_num_threads(int(sys.argv[2]))
    path = Path(sys.argv[1])
    gemm_selection.selection_path = lambda: path
    weight = torch.randn(256, 256)
    selection, _ = gemm_selection.measure(weight, gemm_selection.LAYER_ROWS)
    pack_weight(weight)
    recorded = json.loads(path.read_text()) if path.exists() else {}
    print(json.dumps({"contention_cpus": selection.contention_cpus, "recorded": list(recorded)}))
    """
)


def test_a_verdict_measured_beside_busy_processes_is_used_but_not_recorded(tmp_path: Path) -> None:
    """A process pinned to (at most) two CPUs measures while as many busy loops share them: the
    verdict's timings are biased by who got preempted, so it must not outlive the load."""
    cpus = sorted(os.sched_getaffinity(0))[:2]

    def pinned() -> None:
        os.sched_setaffinity(0, cpus)

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pinned) for _ in cpus]
    try:
        result = subprocess.run(
            [sys.executable, "-c", MEASURE_IN_PINNED_PROCESS, str(tmp_path / "v.json"), str(len(cpus))],
            preexec_fn=pinned,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["contention_cpus"] > CONTENTION_LIMIT_CPUS
    assert report["recorded"] == []  # measured, used for this load, and forgotten


def test_an_unrecorded_verdict_serves_every_layer_of_its_shape_in_this_process(
    selection_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A contended verdict is measured once per process and shape, not once per layer."""
    monkeypatch.setattr(gemm_selection, "CONTENTION_LIMIT_CPUS", -1.0)  # every measurement contended
    measured: list[tuple[int, ...]] = []
    real_measure = gemm_selection.measure

    def counting_measure(weight: torch.Tensor, rows: tuple[int, ...], swiglu: Any = None):  # type: ignore[no-untyped-def]
        measured.append(tuple(weight.shape))
        return real_measure(weight, rows, swiglu)

    monkeypatch.setattr(gemm_selection, "measure", counting_measure)
    layers = [pack_weight(torch.randn(64, 48)) for _ in range(3)] + [pack_weight(torch.randn(32, 48))]
    assert measured == [(64, 48), (32, 48)]
    assert len({layer.backend for layer in layers[:3] if layer is not None}) == 1
    assert not selection_file.exists()  # used by this process, recorded nowhere


def test_a_loaded_model_logs_the_backend_each_layer_runs(
    selection_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One line per load names each layer's GEMM backend, as the layers really run: what a rank
    pod's log tells of its kernels."""
    model = torch.nn.Module()
    model.qkv_proj = ColumnParallelLinear(64, 96, bias=False, params_dtype=torch.float32)
    model.gate_up_proj = SiluGatedLinear(64, [40, 40], params_dtype=torch.float32)
    for parameter in model.parameters():
        parameter.data.normal_()
    with caplog.at_level("INFO", logger="tessera.models.layers.linear"):
        process_weights_after_loading(model)
    [line] = [
        record.getMessage() for record in caplog.records if record.getMessage().startswith("GEMM backends")
    ]
    qkv = model.qkv_proj.packed_weight
    gate_up = model.gate_up_proj
    assert qkv is not None
    expected_gate_up = (
        f"gated {gate_up.gated_weight.backend}"
        if gate_up.gated_weight is not None
        else gate_up.packed_weight.backend
    )
    assert line == f"GEMM backends: qkv_proj {qkv.backend}; gate_up_proj {expected_gate_up}"
    recorded = json.loads(selection_file.read_text())
    assert (
        recorded[gemm_selection.selection_key(torch.empty(96, 64), gemm_selection.LAYER_ROWS)]["backend"]
        == qkv.backend
    )
