"""Pinning a rank's torch threads one per CPU, as vLLM's CPU backend does.

Why: every parallel op ends at a barrier where libgomp's threads meet, hundreds of times a step.
Unpinned, the kernel may park two of them on one CPU while another process runs on the other,
and each barrier then waits out a time slice. Measured on a 2-core VM beside one busy-looping
process, the offline workload ran at 60-63 output tok/s unpinned and 84-96 pinned. Alone on the
VM it cuts both ways: alike in one hour, 8-10% slower pinned in another (a pinned thread cannot
leave a vCPU the hypervisor is stealing from). So threads stay unpinned unless asked.

Pinning moves the calling thread too (it is thread 0 of the pool), and children inherit its
mask, so ``auto`` pins only in Tessera's own processes (the engine core of ``tessera serve``
and the rank processes), and only when the process's CPUs are exactly the ones its threads
use: a container given whole CPUs, or the local ranks sharing out a machine. A pod that
merely sees all of a node's CPUs could be pinned on top of its neighbours, so it is not.
"""

from __future__ import annotations

import logging
import re

from tessera import config
from tessera.host import PROCESS_CPUS

logger = logging.getLogger(__name__)

# Set by the entry points of Tessera's own processes: pinning there moves nobody else's threads.
OWN_PROCESS = False
CPU_LIST = re.compile(config.CPU_LIST)


def parse_cpus(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8], in the given order."""
    if not CPU_LIST.fullmatch(text):
        raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3 or 0,2)")
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"CPU list {text!r} names a CPU twice")
    return cpus


def choose_cpus(
    setting: str,
    threads: int,
    allowed: set[int],
    local_rank: int = 0,
    local_world_size: int = 1,
    own_process: bool = False,
) -> list[int] | None:
    """The CPUs for threads 0..threads-1 of this rank, or None to leave them unpinned.

    ``setting`` is ``auto``, ``none``, or a CPU list: one CPU per thread, or one per thread of
    every local rank (each rank then takes its slice, in local-rank order)."""
    if setting == "none":
        return None
    if setting == "auto":
        if not own_process or local_world_size * threads != len(allowed):
            return None
        cpus = sorted(allowed)
    else:
        cpus = parse_cpus(setting)
        if len(cpus) not in (threads, threads * local_world_size):
            raise ValueError(
                f"cpu_binding {setting!r} names {len(cpus)} CPUs for {threads} threads"
                + (f" x {local_world_size} local ranks" if local_world_size > 1 else "")
            )
        if missing := sorted(set(cpus) - allowed):
            raise ValueError(
                f"cpu_binding {setting!r}: CPUs {missing} are outside this process's {sorted(allowed)}"
            )
    if len(cpus) > threads:
        cpus = cpus[local_rank * threads : (local_rank + 1) * threads]
    return cpus


def bind_threads(
    setting: str, threads: int, local_rank: int = 0, local_world_size: int = 1
) -> list[int] | None:
    """Pin torch's ``threads`` threads (call after ``torch.set_num_threads``); the CPUs, or None."""
    cpus = choose_cpus(setting, threads, set(PROCESS_CPUS), local_rank, local_world_size, OWN_PROCESS)
    if cpus is None:
        return None
    from tessera.kernels import cpu_kernels

    ops = cpu_kernels()
    if ops is None:
        logger.warning("threads left unpinned: the CPU kernels (which pin them) could not be built")
        return None
    failed = [cpu for cpu, ok in zip(cpus, ops.bind_threads(cpus), strict=True) if not ok]
    if failed:
        raise OSError(f"could not pin threads to CPUs {failed}")
    logger.info("torch threads pinned one per CPU: %s", ",".join(map(str, cpus)))
    return cpus
