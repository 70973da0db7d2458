"""A CPU rank keeps the memory a step frees for the next step (glibc's malloc thresholds)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tessera.engine.arg_utils import add_engine_args, engine_config_from_args

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

# In a fresh process: malloc's state is the process's, and the setting lasts for its lifetime.
_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, resource, torch
    from tessera.worker.cpu_memory import retain_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    MB = 1 << 20

    def one_step():
        '''A prefill step's activations (24 MB each, four alive at once), freed at its end: where they
        came from, the heap left after the step, the pages the step faulted in.'''
        before, faults = libc.mallinfo2(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        activations = [torch.ones(2048, 3072) for _ in range(4)]
        live = libc.mallinfo2()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        del activations
        return {"mmapped_mb": (live.hblkhd - before.hblkhd) // MB, "heap_mb": libc.mallinfo2().arena // MB,
                "faults": faults}

    torch.set_num_threads(1)
    default = one_step()
    applied = retain_freed_memory()
    steps = [one_step() for _ in range(8)]
    print(json.dumps({"default": default, "applied": applied, "again": retain_freed_memory(), "steps": steps}))
    """
)


def test_a_step_reuses_freed_memory_without_faulting_it_in_again() -> None:
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # glibc's default: allocations this large are fresh mmaps, faulted in and zeroed page by page.
    assert report["default"]["mmapped_mb"] >= 90 and report["default"]["faults"] > 20000
    assert report["applied"] is True and report["again"] is True
    steps = report["steps"]
    # From the heap, never mmapped; and the heap keeps the memory once the step frees it ...
    assert all(step["mmapped_mb"] == 0 and step["heap_mb"] >= 90 for step in steps), steps
    # ... so once it has grown to what the steps need (glibc's aligned allocations fragment it
    # for a few steps first), it stops growing and a step faults nothing in.
    settled = steps[-3:]
    assert len({step["heap_mb"] for step in settled}) == 1, steps
    assert all(step["faults"] < 64 for step in settled), steps


@pytest.mark.parametrize("flags", [[], ["--no-retain-freed-memory"]])
def test_the_flag_decides_whether_a_cpu_rank_applies_it(
    flags: list[str], tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from tessera.worker import worker

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args([*flags, "--num-threads", "1"]), "m", environ={})
    config = config.model_copy(update={"model": str(tiny_llama_dir), "device": "cpu"})
    applied: list[bool] = []
    monkeypatch.setattr(worker, "retain_freed_memory", lambda: applied.append(True) or True)
    threads = torch.get_num_threads()
    try:
        worker.Worker(config, tiny_llama_dir)
    finally:
        torch.set_num_threads(threads)  # a Worker sets its process's threads
    assert applied == ([] if flags else [True])
