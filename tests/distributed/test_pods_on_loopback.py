"""A leader pod (`tessera serve`) and worker pods (`tessera worker`) started from nothing but what
the operator's pod builder writes serve the `openai` client with single-rank greedy output: a pod
per rank, and a pod per pipeline stage holding its TP group (spec.template.ranksPerPod)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import pytest

from tessera import LLM, SamplingParams
from tessera_operator.api import InferenceClusterSpec
from tests.distributed.rank_processes import children_of, cmdline, kill_all, rank_pod_processes, wait_all_exit
from tests.serving.server import wait_healthy

PROMPTS = ["Once upon a time", "The quick brown fox", "Tensor parallelism splits"]
POD_EXIT_WITHIN_S = 5.0


@pytest.mark.slow
def test_operator_built_pods_serve_the_openai_client(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = InferenceClusterSpec.model_validate(
        {
            "model": {"source": str(tiny_llama_dir), "servedName": "tiny", "maxModelLen": 256},
            "parallelism": {"tensor": 2, "pipeline": 2, "sequenceParallel": True},
            "engine": {"kvCacheMemory": "8Mi", "maxNumSeqs": 8},
        }
    )
    reference = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    # The last pod comes well after the collective timeout: the rendezvous must wait for it
    # (it starts only once every rank has joined), not time out in the ranks already there.
    monkeypatch.setenv("TESSERA_COLLECTIVE_TIMEOUT", "6")
    procs, port = rank_pod_processes(spec, tmp_path, last_pod_delay_s=8.0)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", procs, 300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        response = client.completions.create(
            model="tiny", prompt=PROMPTS, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        texts = [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]
        assert texts == [r.outputs[0].text for r in reference]
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        assert chat.choices[0].message.content
        # A clean stop of the leader stops every rank.
        procs[0].terminate()
        statuses = wait_all_exit(procs, 30)
        assert None not in statuses.values(), f"ranks still running 30 s after the leader stopped: {statuses}"
    finally:
        kill_all(procs)


@pytest.mark.slow
def test_a_pod_per_stage_serves_single_rank_output_and_dies_with_any_of_its_ranks(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """spec.template.ranksPerPod = tensor: the leader pod runs stage 0's two TP ranks beside the
    engine core, the worker pod runs stage 1's two; killing one rank process of a pod makes that
    pod's command exit non-zero promptly, and the group's other pod follows."""
    spec = InferenceClusterSpec.model_validate(
        {
            "model": {"source": str(tiny_llama_dir), "servedName": "tiny", "maxModelLen": 256},
            "parallelism": {"tensor": 2, "pipeline": 2},
            "engine": {"kvCacheMemory": "8Mi", "maxNumSeqs": 8},
            "template": {"ranksPerPod": 2},
        }
    )
    reference = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    procs, port = rank_pod_processes(spec, tmp_path)
    assert len(procs) == 2  # a pod per stage
    try:
        wait_healthy(f"http://127.0.0.1:{port}", procs, 300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        response = client.completions.create(
            model="tiny", prompt=PROMPTS, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        texts = [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]
        assert texts == [r.outputs[0].text for r in reference]
        worker_pod = procs[1]
        ranks = [pid for pid in children_of(worker_pod.pid) if b"worker" in cmdline(pid)]
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        status = wait_all_exit([worker_pod], POD_EXIT_WITHIN_S)[worker_pod.pid]
        assert status not in (None, 0), (
            f"the worker pod's status {POD_EXIT_WITHIN_S} s after its rank died: {status}"
        )
        statuses = wait_all_exit(procs, 30)
        assert None not in statuses.values() and 0 not in statuses.values(), statuses
    finally:
        kill_all(procs)
