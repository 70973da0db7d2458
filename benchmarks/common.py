"""Helpers every benchmark shares: where results go, what machine produced them, its matmul peak.

A result is one JSON file (numbers + the environment that produced them) and one PNG plot
with the same stem in ``benchmarks/results/``: ``<benchmark>_<machine kind>``, the kind read from
this CPU (``machine_kind``) unless ``TESSERA_BENCH_TAG`` names it, so each machine kind keeps its
latest run of each benchmark beside the other kinds'.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# Timed rounds per dtype when two engines take turns: even, so each goes first equally often.
# On the 2-core VM the engine second in a round measured 5-15% slower, whichever it was
# (offline fp32: the rounds vLLM went first gave 0.98-1.00x, those Tessera went first 1.02-1.36x).
DEFAULT_ROUNDS = 4


def ratio_summary(ratios: list[float], tessera_first: list[bool]) -> dict[str, Any]:
    """Tessera / peer over rounds: the median (the headline) and the median of each order's rounds,
    so that an advantage of going first shows instead of hiding in the headline."""

    def median_of(first: bool) -> float | None:
        chosen = [
            ratio for ratio, went_first in zip(ratios, tessera_first, strict=True) if went_first == first
        ]
        return statistics.median(chosen) if chosen else None

    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "by_round": ratios,
        "median_tessera_first": median_of(True),
        "median_peer_first": median_of(False),
    }


def median_index(values: list[float]) -> int:
    """Index of the median value (of an even count, the lower of the middle two): an engine's
    reported round is its median one, and never the luckier of two."""
    ordered = sorted(range(len(values)), key=values.__getitem__)
    return ordered[(len(ordered) - 1) // 2]


def order_note(tessera_first: float | None, peer_first: float | None) -> str:
    """'median with Tessera first 1.20x, with vLLM first 1.05x' (a side with no round is left out)."""
    parts = [
        f"with {label} first {value:.2f}x"
        for label, value in (("Tessera", tessera_first), ("vLLM", peer_first))
        if value is not None
    ]
    return "median " + ", ".join(parts) if parts else ""


# The CPUs this process may run on (the affinity mask, which containers narrow), read at import:
# before an engine in this process pins the calling thread, whose mask children would inherit.
ALLOWED_CPUS: list[int] = (
    sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
)


@contextmanager
def group_stopped(group: int | None) -> Iterator[None]:
    """Process group ``group`` (None: nothing) stopped with SIGSTOP for the block, resumed with
    SIGCONT after: the idle peer engine while Tessera is timed, so Tessera runs on a quiet machine
    as vLLM does (Tessera's idle engine is quiet). A waiting vLLM is not: its 13
    ``gloo_tcp_loop`` threads woke about 100 times a second each, 1,300 wake-ups a second in all
    (an idle Tessera server: about 15), and on a 2-core EPYC Turin VM they cost the offline fp32
    round timed beside them about 4% (11.6 s against 11.0-11.2 s with vLLM stopped): every op's
    threads wait at its barrier for the one that was preempted."""
    if group is not None:
        with suppress(ProcessLookupError):
            os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        if group is not None:
            with suppress(ProcessLookupError):
                os.killpg(group, signal.SIGCONT)


def available_cores() -> int:
    """Cores this process may run on, not the host's."""
    return len(ALLOWED_CPUS)


def set_threads(num_threads: int | None) -> int:
    """Pin torch's intra-op threads (default: all available cores) and return the count used."""
    threads = num_threads or available_cores()
    torch.set_num_threads(threads)
    return threads


def exit_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``) unwind like Ctrl-C, so that every server and peer
    process a benchmark started is stopped by its ``finally`` instead of left spinning."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def git_revision() -> str | None:
    # Read-only query; a benchmark run outside a checkout simply has no revision.
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# TESSERA_CPU_ISA builds Tessera's kernels for another CPU kind's instructions (tessera.kernels.isa).
# A race run so holds the peer and the libraries both engines call (oneDNN, MKL) to the same
# instructions: the race that kind's code would run, on this machine's cores, caches and memory.
# An approximation of that kind, not a measurement of it.
_HELD_ISA_ENVIRONMENTS = {
    "avx512-bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}
# A folder whose sitecustomize.py turns AMX off in torch, for the peer's PYTHONPATH: vLLM picks its
# attention kernels by torch's answer, in every process it starts (they inherit the path).
PEER_SITE = "TESSERA_BENCH_PEER_SITE"
_AMX_OFF = "import torch\n\ntorch.cpu._is_amx_tile_supported = lambda: False\n"
# What hold_to_cpu_isa set, for the JSON.
_held_environment: dict[str, str] = {}


def hold_to_cpu_isa() -> dict[str, str]:
    """Hold this process (and the peers it starts) to the instructions TESSERA_CPU_ISA names;
    returns the variables set. Call before the first GEMM: oneDNN and MKL read them once."""
    from tessera.kernels import isa

    variant = isa.requested_variant()
    if variant is None:
        return {}
    held = _HELD_ISA_ENVIRONMENTS.get(variant)
    if held is None:
        raise SystemExit(
            f"{isa.VARIABLE}={variant}: the benchmarks can hold vLLM to {', '.join(_HELD_ISA_ENVIRONMENTS)} only"
        )
    site = tempfile.mkdtemp(prefix="tessera-peer-without-amx-")
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    Path(site, "sitecustomize.py").write_text(_AMX_OFF)
    os.environ.update(held)
    os.environ[PEER_SITE] = site
    _held_environment.update({isa.VARIABLE: variant, **held})
    return dict(_held_environment)


def peer_python_path() -> dict[str, str]:
    """PYTHONPATH for a peer's processes: the held instruction set's sitecustomize, if any."""
    return {"PYTHONPATH": os.environ[PEER_SITE]} if PEER_SITE in os.environ else {}


KERNEL_SETTINGS = ("TESSERA_GEMM_BACKEND", "TESSERA_CPU_KERNELS", "TESSERA_CPU_ISA")


def environment_info() -> dict[str, Any]:
    """What a reader needs to compare two result files: hardware, threads, versions, revision."""
    from tessera import host

    return {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": host.cpu_model(),
        "cpu_flags": sorted(host.cpu_flags()),
        "cpu_count_host": os.cpu_count(),
        "cpu_count_available": available_cores(),
        "torch_num_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "tessera": package_version("tessera"),
        "git_revision": git_revision(),
        "held_to_cpu_isa": dict(_held_environment) or None,
        # Settings that change which kernels Tessera runs (a forced GEMM backend, kernels off).
        "tessera_kernel_settings": {name: os.environ[name] for name in KERNEL_SETTINGS if name in os.environ},
    }


def measure_matmul_peak(
    dtype: torch.dtype = torch.float32,
    sizes: tuple[int, ...] = (1024, 2048, 3072),
    repeats: int = 5,
    budget_s: float = 3.0,
) -> dict[str, Any]:
    """Best FLOP/s of square GEMMs at the current thread count: the machine's practical peak.

    The best of ``torch.mm`` and every GEMM backend Tessera can choose here
    (``tessera.kernels.gemm``, weights packed once): which is fastest differs between CPUs, and
    on a CPU without bf16 instructions ``torch.mm`` in bf16 runs at a few GFLOP/s, far below the
    kernels that widen bf16 to fp32. Large squares are as close to peak as a GEMM gets; the best
    of several sizes and repeats filters out warm-up and noise from other processes. A form whose
    single call takes over ``budget_s / repeats`` is not tried at larger sizes.
    """
    from tessera.kernels.gemm import candidates

    best_by_form: dict[str, float] = {}
    per_size: dict[str, float] = {}
    slow: set[str] = set()
    for n in sizes:
        a = torch.randn(n, n).to(dtype)
        w = torch.randn(n, n).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        forms: dict[str, Any] = {"torch.mm": functools.partial(torch.mm, a, w.t(), out=out)}
        for backend in candidates(w):
            if backend.name != "aten":  # the same kernel as torch.mm
                forms[backend.name] = functools.partial(backend.pack(w).matmul, a, None)
        for name, call in forms.items():
            if name in slow:
                continue
            started = time.perf_counter()
            call()  # warm-up
            calls = 1 if time.perf_counter() - started > budget_s / repeats else repeats
            if calls == 1:
                slow.add(name)
            form_best = 0.0
            for _ in range(calls):
                started = time.perf_counter()
                call()
                form_best = max(form_best, 2.0 * n**3 / (time.perf_counter() - started))
            best_by_form[name] = max(best_by_form.get(name, 0.0), form_best)
            per_size[str(n)] = max(per_size.get(str(n), 0.0), form_best)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "peak_flops": max(best_by_form.values()),
        "best_form": max(best_by_form, key=best_by_form.__getitem__),
        "flops_by_form": best_by_form,
        "flops_by_size": per_size,
    }


# What measure_memory_read reads, and how often (the best pass counts).
MEMORY_READ_MB, MEMORY_READ_REPEATS = 512, 3


def measure_memory_read(megabytes: int = MEMORY_READ_MB, repeats: int = MEMORY_READ_REPEATS) -> float:
    """Best GB/s of reading a buffer larger than the caches (``torch.sum``, current thread count).

    A shared VM's memory bandwidth moves with its neighbours' load (11 to 29 GB/s between hours
    on one 2-vCPU Xeon); when it is low, both engines of a race wait on the same bytes and their
    ratio shrinks toward 1, so a result records it at its start and its end.
    """
    buffer = torch.ones(megabytes << 18)  # float32: 2**18 of them per MB
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.numel() * buffer.element_size() / (time.perf_counter() - started))
    return round(best / 1e9, 1)


def memory_read_report(at_start: float) -> dict[str, Any]:
    """The run's memory bandwidth at its start (``at_start``) and now, printed and for its JSON."""
    at_end = measure_memory_read()
    print(
        f"memory read at {torch.get_num_threads()} threads: {at_start} GB/s at the start, {at_end} at the end"
    )
    return {
        "start": at_start,
        "end": at_end,
        "threads": torch.get_num_threads(),
        "method": f"torch.sum of {MEMORY_READ_MB} MB, best of {MEMORY_READ_REPEATS}",
    }


def _single_thread_gemm_rate(ready: Any, start: Any, seconds: float, result: Any) -> None:
    """Decoder-shaped fp32 GEMMs (64 rows x 576 -> 1536) on one thread for ``seconds``."""
    torch.set_num_threads(1)
    x, w = torch.randn(64, 576), torch.randn(1536, 576)
    torch.nn.functional.linear(x, w)  # warm-up
    ready.set()
    start.wait()
    done, stop_at = 0, time.perf_counter() + seconds
    while time.perf_counter() < stop_at:
        torch.nn.functional.linear(x, w)
        done += 1
    result.put(done / seconds)


def measure_process_scaling(processes: int = 2, seconds: float = 5.0) -> dict[str, Any]:
    """How much work ``processes`` single-thread processes get done together versus one alone.

    The ceiling of any multi-rank speedup on this machine: vCPUs may share a physical core or
    memory bandwidth, so N "cores" need not give N times one core's work.
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")

    def run(count: int) -> float:
        ready = [context.Event() for _ in range(count)]
        start, result = context.Event(), context.Queue()
        workers = [
            context.Process(target=_single_thread_gemm_rate, args=(r, start, seconds, result)) for r in ready
        ]
        for worker in workers:
            worker.start()
        for event in ready:
            event.wait()
        start.set()
        total = sum(result.get() for _ in workers)
        for worker in workers:
            worker.join()
        return total

    alone = run(1)
    together = run(processes)
    return {
        "processes": processes,
        "workload": "fp32 linear 64x576 -> 1536, one thread per process",
        "calls_per_s_one_process": alone,
        "calls_per_s_all_processes": together,
        "speedup": together / alone,
    }


MACHINE_KINDS = ("milan", "genoa", "turin", "icelake", "xeon_amx")


def machine_kind() -> str:
    """This CPU's kind as the results name it (one of MACHINE_KINDS; ``other`` for a kind not
    listed), from its vendor and flags: a VM may hide the model's name."""
    from tessera import host

    flags, model = host.cpu_flags(), host.cpu_model()
    if "amx_tile" in flags:
        return "xeon_amx"
    if "AMD" in model:
        if "avx512f" in flags:
            return "turin" if "avx_vnni" in flags else "genoa"  # Zen 5 added AVX-VNNI, Zen 4 lacks it
        return "milan" if "avx2" in flags else "other"
    if "Intel" in model and "avx512f" in flags and "avx512_bf16" not in flags:
        return "icelake"
    return "other"


def result_path(name: str, suffix: str) -> Path:
    """``results/<name>_<machine kind><suffix>`` (the kind: ``TESSERA_BENCH_TAG`` if set and not
    empty, else ``machine_kind()``), its folder created."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    tag = os.environ.get("TESSERA_BENCH_TAG") or machine_kind()
    return RESULTS_DIR / f"{name}_{tag}{suffix}"


def write_json(name: str, data: dict[str, Any]) -> Path:
    path = result_path(name, ".json")
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def save_figure(name: str, figure: Any) -> Path:
    """Write a matplotlib figure as ``results/<name>_<machine kind>.png`` (as the JSON) and close it."""
    import matplotlib.pyplot as plt

    path = result_path(name, ".png")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.5, nrows: int = 1) -> tuple[Any, Any]:
    """A figure on the non-interactive backend (benchmarks run headless); ``width`` and ``height``
    are each subplot's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
