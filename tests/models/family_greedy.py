"""A model family's greedy tokens through the engine equal transformers' own greedy loop.

The reference is the plainest one: transformers' forward over the whole sequence at every step
(fp32, eager attention, no KV cache, one prompt at a time), the argmax appended. The engine
runs the same prompts concurrently with chunked prefill, preemption and prefix-cache hits. A
mismatch is accepted only at a near-tie (the reference's two most likely tokens within
``NEAR_TIE`` in log-probability at the first difference), and every accepted one is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera import LLM, SamplingParams
from tests.distributed.equivalence import NEAR_TIE
from tests.engine.test_llm_greedy import StatsRecorder, prompts_of_varied_lengths


@dataclass
class GreedyReport:
    """What a comparison found: requests identical to the reference, and accepted near-ties."""

    requests: int = 0
    identical: int = 0
    near_ties: list[str] = field(default_factory=list)


def reference_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[tuple[int, float]]]:
    """Per prompt, each greedy token with the top-two log-probability gap at its position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, steps = list(prompt), []
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
                top = logits.log_softmax(-1).topk(2)
                steps.append((int(top.indices[0]), float(top.values[0] - top.values[1])))
                ids.append(steps[-1][0])
            results.append(steps)
    return results


def check_family_greedy(
    model_dir: Path, max_new_tokens: int = 12, num_kv_blocks: int = 30, **engine_args: object
) -> GreedyReport:
    """Run ``prompts_of_varied_lengths`` (16 prompts, 8 sharing a prefix) through the engine and
    the reference; fail on a mismatch that is not a near-tie. Returns the report (print it)."""
    prompts = prompts_of_varied_lengths()
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_num_batched_tokens=64,  # chunks the longer prompts
        num_kv_blocks=num_kv_blocks,  # small enough to preempt
        block_size=16,
        max_model_len=256,
        enable_prefix_caching=True,
        **engine_args,
    )
    try:
        tokenizer = llm.get_tokenizer()
        prompt_ids = [tokenizer(p).input_ids for p in prompts]
        expected = reference_greedy(model_dir, prompt_ids, max_new_tokens)
        recorder = StatsRecorder(llm)
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        assert recorder.prefix_hits > 0, "the shared prefix was meant to hit the prefix cache"
        assert recorder.max_running > 1, "requests were meant to run concurrently"
        assert llm.engine.scheduler.kv.usage == 0.0
    finally:
        llm.engine.shutdown()
    report = GreedyReport(requests=len(prompts))
    for index, (steps, output) in enumerate(zip(expected, outputs, strict=True)):
        got = output.outputs[0].token_ids
        want = [token for token, _ in steps]
        if got == want:
            report.identical += 1
            continue
        position = next(i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
        gap = steps[position][1]
        assert gap < NEAR_TIE, (
            f"{model_dir.name}: request {index} differs at token {position}: reference {want[position]} "
            f"vs {got[position]} with a top-two gap of {gap:.2e} (not a near-tie)\n"
            f"reference: {want}\nengine:    {got}"
        )
        report.near_ties.append(f"request {index} token {position} (gap {gap:.1e})")
    print(f"{model_dir.name}: {report.identical}/{report.requests} identical, near-ties: {report.near_ties}")
    return report
