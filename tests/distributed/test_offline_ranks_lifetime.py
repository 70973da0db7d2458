"""An offline parallel LLM owns its rank processes: they outlive the thread that built it and
end with the object (or `shutdown()`), leaving no process and no IPC folder behind."""

from __future__ import annotations

import gc
import glob
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

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
    # A terminal's Ctrl-C reaches the whole process group: it is for the caller, and the ranks
    # under it must still serve the next call.
    for pid in ranks:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
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


BUILD_ON_A_THREAD = """
import sys, threading, time
from tessera import LLM
built = []
build = lambda: built.append(LLM(sys.argv[1], pipeline_parallel_size=2, num_threads=1))
threading.Thread(target=build).start()
time.sleep(600)
"""


def test_ranks_of_a_process_killed_while_they_start_exit_at_once(tiny_llama_dir: Path) -> None:
    """Built on a thread, the ranks get no parent-death signal; killed before its ranks were ready,
    the process could not tell them to go, and they must not wait the startup timeout for it."""
    pattern = os.path.join(tempfile.gettempdir(), "tessera-ranks-*")
    before = set(glob.glob(pattern))
    parent = subprocess.Popen([sys.executable, "-c", BUILD_ON_A_THREAD, str(tiny_llama_dir)])
    try:
        deadline = time.monotonic() + 60
        ranks: list[int] = []
        while len(ranks) < 2 and time.monotonic() < deadline:
            ranks = [pid for pid in children_of(parent.pid) if b"worker" in cmdline(pid)]
            time.sleep(0.05)
        assert len(ranks) == 2, "the ranks never started"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(exited(pid) for pid in ranks):
        time.sleep(0.2)
    orphans = [pid for pid in ranks if not exited(pid)]
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not orphans, "ranks outlived the process that started them"
    assert set(glob.glob(pattern)) == before  # the last rank out removed their socket folder


def test_ranks_start_when_the_engine_cores_folder_is_too_deep_for_their_socket(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long TMPDIR (a batch scheduler's) leaves the core's own sockets room but not the ranks'
    one folder deeper: their folder then goes in the temporary folder itself."""
    from tessera.worker.worker_proc import RANKS_IPC_PARENT_ENV

    deep = tmp_path / ("d" * max(1, 90 - len(str(tmp_path))))  # its sockets would need 117
    deep.mkdir()
    monkeypatch.setenv(RANKS_IPC_PARENT_ENV, str(deep))
    with LLM(str(tiny_llama_dir), pipeline_parallel_size=2, max_model_len=128, num_threads=1) as llm:
        out = llm.generate("Once upon", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2
    assert list(deep.iterdir()) == []
