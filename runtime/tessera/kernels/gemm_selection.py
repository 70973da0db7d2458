"""Choose each weight's GEMM backend by measuring the candidates on this machine, once.

A choice is per ``(out, in, dtype, threads, row profile, candidates)``: tensor-parallel shards are
measured at their own shapes. It is recorded in ``gemm_selection.v4.json`` beside the native
kernel build (same folder, same key: torch version, CPU flags, kernel sources), so a machine
measures a shape once and every later load, on any rank, reuses the verdict. Verdicts under the
same key in the read-only prebuilt cache (an image's, or the host's that `make demo` mounts into
rank pods) serve where this cache has none, so pods starting together need not measure at all.
``TESSERA_GEMM_BACKEND=aten|mkl|onednn|mkl_fp32|panels|amx`` forces one backend where it is supported.

Scoring: each candidate is timed at every row count of the profile (decode-sized and
prefill-sized batches), its packed weight evicted from the caches before every call (a decode
step streams every layer's weights, so each GEMM meets its weight in memory, not in cache), and
scored by the geometric mean of its time relative to the fastest
candidate at that row count, so a shape that is slow at prefill and one slow at decode weigh
alike, whatever the absolute times. Scores within SCORE_TIE of the best are a tie, which the
smallest packed form wins: MKL's packed copy of SmolLM2's QKV weight is 5x the weight (11.6 MB
against 2.2), and on a Xeon with AMX it tied with the panels (scores 1.015 and 1.021) while
holding 280 MB more over 30 layers, bytes a memory-bound decode step may have to stream.

SwiGLU's gate_up weight is timed as its layer runs it (``select_swiglu_product``, key suffix
``:swiglu``): the backends with a gated kernel (``GATED_KERNELS``) through it, with the activation
in the GEMM's epilogue, every other backend followed by the activation pass. On a Xeon with AMX,
SmolLM2's fp32 gate_up scored MKL at 1.01-1.08 of the panels' time on the plain product and 1.17
as the layer runs it: a backend that wins a plain product by less than the pass costs would
otherwise be chosen and run the layer slower.

A verdict is recorded only when nothing else wanted the CPUs while it was measured: other
processes' CPU time (and the hypervisor's steal) beyond the cores this process leaves free
biases the timings, as OpenMP's threads suffer more from a preempted peer than a less parallel
GEMM does, and a verdict recorded once is reused for as long as the build lasts. A contended
verdict serves the process that measured it (every layer of that shape, so a model's 30 layers
cost one measurement per shape, not 30); the next process measures again.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera import host
from tessera.kernels import native_ops
from tessera.kernels.build import build_key, cache_root
from tessera.kernels.gemm import BACKENDS, GemmBackend, PackedWeight, SwiGLUProduct, candidates

logger = logging.getLogger(__name__)

# v2: verdicts measured while other processes held the CPUs are no longer recorded, and the
# first file may hold such verdicts (MKL over oneDNN on an EPYC where oneDNN wins every shape).
# v3: timed on weights evicted from the caches; v2's were timed on cached weights.
# v4: ties go to the smallest packed form; v3 took the best score however small the margin.
SELECTION_FILE = "gemm_selection.v4.json"
FORCE_VARIABLE = "TESSERA_GEMM_BACKEND"
# Rows a linear layer multiplies: decode batches and prefill chunks.
LAYER_ROWS = (8, 64, 512)
# The LM head only sees the last position of each sequence in a step.
LM_HEAD_ROWS = (8, 64)
_MIN_ROUNDS, _TIME_BUDGET_S = 5, 0.03
# Scores this close to the best (relative) are within the measurement's noise: a tie.
SCORE_TIE = 0.02
# Largest weight measured whole (see measure_sample); SmolLM2's fp32 LM head is 113 MB.
MEASURE_BYTES_LIMIT = 128 << 20
# CPUs' worth of other work during a measurement beyond which its verdict is not recorded.
CONTENTION_LIMIT_CPUS = 0.3
_PROC_STAT = Path("/proc/stat")
# selection key -> backend of the verdicts this process measured but did not record. Before, each
# layer measured its shape again: rank pods starting together on a busy node never record, and
# spent 70 s of a 75 s model load re-measuring (2 groups of 2 SmolLM2 stages on 2 cores).
_unrecorded_verdicts: dict[str, str] = {}


@dataclass(frozen=True)
class Selection:
    backend: str
    measured: dict[str, float]  # backend -> score (1.0 = fastest at every row count)
    packed_bytes: dict[str, int]  # backend -> bytes of its packed form of the measured weight
    # CPUs' worth of other processes' work (and steal) beyond the cores this process left free.
    contention_cpus: float = 0.0

    @property
    def contended(self) -> bool:
        return self.contention_cpus > CONTENTION_LIMIT_CPUS


def _busy_seconds(cpus: frozenset[int]) -> float | None:
    """CPU time ``cpus`` have spent busy (stolen time included), from ``/proc/stat``; None off Linux."""
    total = 0
    try:
        lines = _PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest time is already in user)
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in values[:8])
        total += user + nice + system + irq + softirq + steal
    return total / os.sysconf("SC_CLK_TCK")


class _ContentionMeter:
    """Other processes' CPU use of this process's CPUs during a span, beyond the CPUs its torch
    threads leave free; this process's own threads only ever run on those CPUs."""

    def __enter__(self) -> _ContentionMeter:
        self._busy = _busy_seconds(host.PROCESS_CPUS)
        self._own, self._wall = time.process_time(), time.perf_counter()
        self.cpus = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        busy = _busy_seconds(host.PROCESS_CPUS)
        if busy is None or self._busy is None:
            return  # nothing to judge by
        wall = max(time.perf_counter() - self._wall, 1e-9)
        others = (busy - self._busy) - (time.process_time() - self._own)
        spare = max(len(host.PROCESS_CPUS) - torch.get_num_threads(), 0)
        self.cpus = max(others / wall - spare, 0.0)


def selection_path() -> Path:
    return cache_root() / build_key() / SELECTION_FILE


# What a layer does with its product, for the selection: nothing, or SwiGLU (see SwiGLUProduct).
Activation = Callable[[torch.Tensor], torch.Tensor]


def selection_key(weight: torch.Tensor, rows: tuple[int, ...], swiglu: bool = False) -> str:
    out_features, in_features = weight.shape
    dtype = str(weight.dtype).removeprefix("torch.")
    # The candidates too: a verdict among fewer backends (kernels disabled, new backend) is no verdict.
    names = ",".join(backend.name for backend in candidates(weight))
    return (
        f"{dtype}:{out_features}x{in_features}:threads={torch.get_num_threads()}"
        f":rows={','.join(map(str, rows))}{':swiglu' if swiglu else ''}:candidates={names}"
    )


@dataclass(frozen=True)
class SelectionKey:
    """What a recorded verdict was measured for (``selection_key`` spelled out)."""

    dtype: str
    out_features: int
    in_features: int
    threads: int
    rows: tuple[int, ...]
    swiglu: bool
    candidates: tuple[str, ...]


def parse_selection_key(key: str) -> SelectionKey:
    """The fields of a ``selection_key``; ValueError for anything else."""
    dtype, shape, *fields = key.split(":")
    named = dict(field.partition("=")[::2] for field in fields if "=" in field)
    try:
        out_features, in_features = (int(size) for size in shape.split("x"))
        return SelectionKey(
            dtype=dtype,
            out_features=out_features,
            in_features=in_features,
            threads=int(named["threads"]),
            rows=tuple(int(count) for count in named["rows"].split(",")),
            swiglu="swiglu" in fields,
            candidates=tuple(named["candidates"].split(",")),
        )
    except (KeyError, ValueError) as error:
        raise ValueError(f"not a GEMM selection key: {key!r}") from error


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def prebuilt_selection_path() -> Path:
    return host.prebuilt_cache_root() / "kernels" / build_key() / SELECTION_FILE


def recorded_selections_by_source() -> dict[str, dict[str, Any]]:
    """Each file's verdicts: the read-only prebuilt cache's (``prebuilt``) and this cache's."""
    return {"prebuilt": _read(prebuilt_selection_path()), "this cache": _read(selection_path())}


def recorded_selections() -> dict[str, Any]:
    """This cache's verdicts, over the prebuilt cache's for the same build key."""
    by_source = recorded_selections_by_source()
    return {**by_source["prebuilt"], **by_source["this cache"]}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive use of the selection file ``path``: ranks loading at once must not drop each
    other's verdicts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{SELECTION_FILE}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield


def forget_recorded() -> int:
    """Deletes this cache's verdicts, so that the next load measures every shape again; returns
    how many there were. The read-only prebuilt cache's verdicts are not this cache's to delete."""
    path = selection_path()
    if not path.exists():
        return 0
    with _locked(path):
        count = len(_read(path))
        path.unlink(missing_ok=True)
    return count


def _record(key: str, selection: Selection) -> None:
    """Merge one verdict into the file."""
    path = selection_path()
    try:
        with _locked(path):
            data = _read(path)
            data[key] = {
                "backend": selection.backend,
                "scores": selection.measured,
                "packed_bytes": selection.packed_bytes,
            }
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, prefix=".selection.") as tmp:
                json.dump(data, tmp, indent=1, sort_keys=True)
            os.replace(tmp.name, path)
    except OSError as error:  # a read-only cache costs a re-measurement next time, nothing else
        logger.warning("could not record the GEMM selection in %s: %s", path, error)


def memory_ranges(form: PackedWeight) -> list[tuple[int, int]]:
    """(address, bytes) of each tensor holding ``form``'s weight; oneDNN's reordered weights are
    opaque tensors, located through its own ops."""
    ranges = []
    for tensor in form.storage():
        if tensor.is_mkldnn:
            ranges.append((torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)))
        else:
            ranges.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
    return ranges


def evict(form: PackedWeight) -> bool:
    """Drops ``form``'s weight from the caches; False where this build cannot (native kernels
    off or unbuildable, or a CPU without a cache-line flush the kernels know)."""
    ops = native_ops(torch.device("cpu"))
    if ops is None:
        return False
    evicted = [ops.evict_from_caches(address, size) for address, size in memory_ranges(form)]
    return all(evicted)  # every range evicted, even after one that could not be


def packed_bytes(form: PackedWeight) -> int:
    return sum(size for _, size in memory_ranges(form))


def choose(scores: dict[str, float], sizes: dict[str, int]) -> str:
    """The backend with the best score, or among those within SCORE_TIE of it the one whose
    packed form is smallest (then the better score)."""
    best = min(scores.values())
    tied = [name for name, score in scores.items() if score <= best * (1 + SCORE_TIE)]
    return min(tied, key=lambda name: (sizes[name], scores[name]))


def _best_times(packed: dict[str, PackedWeight], x: torch.Tensor) -> dict[str, float]:
    """Best time of each form on ``x``, its weight evicted from the caches before each call, in
    interleaved rounds: on a shared machine a burst of load then slows every candidate alike
    instead of deciding the verdict."""
    for form in packed.values():
        form.matmul(x, None)  # warm-up: first-call allocations and oneDNN primitive creation
    best = dict.fromkeys(packed, math.inf)
    spent, rounds = 0.0, 0
    while rounds < _MIN_ROUNDS or spent < _TIME_BUDGET_S * len(packed):
        for name, form in packed.items():
            evict(form)
            started = time.perf_counter()
            form.matmul(x, None)
            elapsed = time.perf_counter() - started
            best[name], spent = min(best[name], elapsed), spent + elapsed
        rounds += 1
    return best


def measure_sample(weight: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """What the candidates race on: ``weight`` itself, or, past MEASURE_BYTES_LIMIT, its first
    output rows (a multiple of 64, the same K): measuring packs every candidate at once, and
    a large model's LM head (2 GB in fp32 for 128k x 4096) would otherwise be packed four times
    over while a pod sized for the model loads. The backends differ per output column and K.
    A SwiGLU gate_up weight (gate rows over up rows) keeps as many rows of each half."""
    row_bytes = weight.shape[1] * weight.element_size()
    if weight.shape[0] * row_bytes <= MEASURE_BYTES_LIMIT:
        return weight
    if not swiglu:
        return weight[: max(64, MEASURE_BYTES_LIMIT // row_bytes // 64 * 64)]
    half = weight.shape[0] // 2
    each = min(half, max(64, MEASURE_BYTES_LIMIT // row_bytes // 2 // 64 * 64))
    return torch.cat([weight[:each], weight[half : half + each]])


def layer_form(backend: GemmBackend, weight: torch.Tensor, swiglu: Activation | None = None) -> PackedWeight:
    """``weight`` in ``backend``'s form, as its layer multiplies it (``swiglu``: see SwiGLUProduct)."""
    return backend.pack(weight) if swiglu is None else SwiGLUProduct(backend.name, weight, swiglu)


def measure(
    weight: torch.Tensor, rows: tuple[int, ...], swiglu: Activation | None = None
) -> tuple[Selection, dict[str, PackedWeight]]:
    """Time every candidate on ``weight`` (or its sample), each as its layer would run it; returns
    the verdict and the forms of the whole weight it built (none when it measured a sample)."""
    sample = measure_sample(weight, swiglu is not None)
    packed = {backend.name: layer_form(backend, sample, swiglu) for backend in candidates(sample)}
    generator = torch.Generator().manual_seed(0)
    log_ratio = dict.fromkeys(packed, 0.0)
    with torch.inference_mode(), _ContentionMeter() as contention:
        for count in rows:
            x = torch.randn(count, weight.shape[1], generator=generator).to(weight.dtype)
            best = _best_times(packed, x)
            fastest = min(best.values())
            for name, elapsed in best.items():
                log_ratio[name] += math.log(elapsed / fastest) / len(rows)
    scores = {name: round(math.exp(value), 3) for name, value in log_ratio.items()}
    sizes = {name: packed_bytes(form) for name, form in packed.items()}
    selection = Selection(choose(scores, sizes), scores, sizes, round(contention.cpus, 2))
    return selection, packed if sample is weight else {}


def _select(
    weight: torch.Tensor, rows: tuple[int, ...], swiglu: Activation | None = None
) -> tuple[str, PackedWeight | None]:
    """The fastest backend's name here (forced, recorded, or measured now) and, when measuring
    built it, its form (``layer_form``)."""
    supported = {backend.name for backend in candidates(weight)}
    forced = os.environ.get(FORCE_VARIABLE)
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{FORCE_VARIABLE}={forced!r}: choose one of {', '.join(BACKENDS)}")
        return (forced if forced in supported else "aten"), None
    if len(supported) == 1:
        return "aten", None
    key = selection_key(weight, rows, swiglu is not None)
    recorded = recorded_selections().get(key)
    if isinstance(recorded, dict) and recorded.get("backend") in supported:
        return recorded["backend"], None
    if key in _unrecorded_verdicts:
        return _unrecorded_verdicts[key], None
    selection, packed = measure(weight, rows, swiglu)
    if selection.contended:
        _unrecorded_verdicts[key] = selection.backend
        logger.info(
            "GEMM %s: %s (scores %s), not recorded: other processes used %.2f CPUs meanwhile",
            key,
            selection.backend,
            selection.measured,
            selection.contention_cpus,
        )
    else:
        logger.info("GEMM %s: %s (scores %s)", key, selection.backend, selection.measured)
        _record(key, selection)
    return selection.backend, packed.get(selection.backend)


def selected_backend(
    weight: torch.Tensor, rows: tuple[int, ...] = LAYER_ROWS, swiglu: Activation | None = None
) -> str:
    """The name of the backend that multiplies ``weight`` fastest here (recorded, or measured now);
    with ``swiglu``, the fastest at SwiGLU's gate_up as its layer runs it (``SwiGLUProduct``)."""
    return _select(weight, rows, swiglu)[0]


def select_backend(weight: torch.Tensor, rows: tuple[int, ...] = LAYER_ROWS) -> PackedWeight:
    """``weight`` in the form of the backend that multiplies it fastest here (recorded, or measured now)."""
    name, packed = _select(weight, rows)
    return packed if packed is not None else BACKENDS[name].pack(weight)


def select_swiglu_product(
    weight: torch.Tensor, swiglu: Activation, rows: tuple[int, ...] = LAYER_ROWS
) -> SwiGLUProduct:
    """SwiGLU's gate_up ``weight`` as the backend fastest at it here multiplies it (recorded, or
    measured now on every candidate as the layer would run it)."""
    name, packed = _select(weight, rows, swiglu)
    return packed if isinstance(packed, SwiGLUProduct) else SwiGLUProduct(name, weight, swiglu)
