"""Where a mixture-of-experts layer spends its time (routing, the expert-parallel exchange, the
expert GEMMs), for ``benchmarks/moe_throughput.py``. Off unless ``TESSERA_MOE_TIMERS=1`` is
in the environment of the rank processes: then each timed phase costs two clock reads."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

PHASES = ("routing", "exchange", "experts")
Result = TypeVar("Result")


class MoeTimers:
    def __init__(self) -> None:
        self.enabled = os.environ.get("TESSERA_MOE_TIMERS") == "1"
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def run(self, phase: str, fn: Callable[..., Result], *args: object) -> Result:
        """``fn(*args)``, its time added to ``phase`` when the timers are on."""
        if not self.enabled:
            return fn(*args)
        started = time.perf_counter()
        result = fn(*args)
        self.seconds[phase] += time.perf_counter() - started
        return result

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def snapshot(self) -> dict[str, float]:
        return {f"moe_{phase}_seconds": seconds for phase, seconds in self.seconds.items()}


MOE_TIMERS = MoeTimers()
