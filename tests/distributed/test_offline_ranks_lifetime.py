"""An offline parallel LLM owns its rank processes: they outlive the thread that built it and
end with the object (or `shutdown()`), leaving no process and no IPC folder behind."""

from __future__ import annotations

import gc
import glob
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tessera import LLM, SamplingParams
from tests.distributed.rank_processes import children_of, cmdline
from tests.distributed.test_rank_faults import exited


def test_ranks_built_on_a_passing_thread_serve_and_go_with_the_llm(tiny_llama_dir: Path) -> None:
    pattern = os.path.join(tempfile.gettempdir(), "tessera-ranks-*")
    before = set(glob.glob(pattern))
    built: dict[str, Any] = {}

    def build() -> None:  # e.g. a web framework's worker thread
        built["llm"] = LLM(str(tiny_llama_dir), pipeline_parallel_size=2, max_model_len=128, num_threads=1)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    llm = built.pop("llm")
    ranks = [pid for pid in children_of(os.getpid()) if b"worker" in cmdline(pid)]
    assert len(ranks) == 2
    time.sleep(1.0)  # a parent-death signal tied to the ended thread would have fired by now
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy)[0].outputs[0].token_ids) == 4
    del llm
    gc.collect()
    assert all(exited(pid) for pid in ranks)
    assert set(glob.glob(pattern)) == before


def test_an_engine_that_fails_to_start_takes_its_ranks_with_it(tiny_llama_dir: Path) -> None:
    pattern = os.path.join(tempfile.gettempdir(), "tessera-ranks-*")
    before_dirs, before_children = set(glob.glob(pattern)), set(children_of(os.getpid()))
    try:
        # The ranks start, then the warm-up finds no room for a prompt and a token.
        LLM(str(tiny_llama_dir), pipeline_parallel_size=2, max_model_len=1, num_threads=1)
    except ValueError as error:
        assert "max_model_len=1" in str(error)
    else:
        raise AssertionError("an engine with max_model_len=1 started")
    assert all(exited(pid) for pid in set(children_of(os.getpid())) - before_children)
    assert set(glob.glob(pattern)) == before_dirs
