"""Prompt logprobs (what `echo` with `logprobs` returns) against transformers' forward pass, over
chunked prefill and a prompt whose prefix sits in the prefix cache."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch

from tessera import LLM, SamplingParams
from tests.engine.reference import hf_prompt_logprobs
from tests.engine.test_llm_greedy import QUESTIONS, SHARED_PREFIX


def test_prompt_logprobs_equal_transformers_across_chunks_and_cached_prefixes(tiny_llama_dir: Path) -> None:
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_num_batched_tokens=16,  # every prompt spans several chunks
        block_size=8,
        max_model_len=256,
        enable_prefix_caching=True,
    )
    tokenizer = llm.get_tokenizer()
    prompts = [SHARED_PREFIX + q for q in QUESTIONS[:3]]
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompts[:1], plain)  # the shared prefix is now cached
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    outputs = llm.generate(prompts, scored)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt).input_ids
        assert output.prompt_token_ids == ids
        entries = output.prompt_logprobs
        assert entries is not None and len(entries) == len(ids) and entries[0] is None
        expected = hf_prompt_logprobs(tiny_llama_dir, ids)
        got = torch.tensor([entry[token].logprob for entry, token in zip(entries[1:], ids[1:], strict=True)])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        for entry, token in zip(entries[1:], ids[1:], strict=True):
            own = entry[token]
            others = [lp for top_id, lp in entry.items() if top_id != token]
            top = sorted([*others, *([own] if len(others) < 3 else [])], key=lambda lp: lp.rank or 0)
            assert [lp.rank for lp in top] == [1, 2, 3]
            assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(top))
            # The prompt token's own rank is in the whole vocabulary, inside the top or not.
            assert own.rank is not None and (own.rank <= 3) == (len(others) < 3)
            assert own.rank > 3 or own is top[own.rank - 1]
            assert entry[token].decoded_token == tokenizer.decode([token])
            assert math.isfinite(entry[token].logprob)
        # The completion is the one a request without prompt logprobs gets.
        assert output.outputs[0].token_ids == llm.generate([prompt], plain)[0].outputs[0].token_ids
    assert llm.engine.scheduler.kv.usage == 0.0


def test_only_the_first_of_n_samples_scores_the_prompt_and_streams_carry_it_once(
    tiny_llama_dir: Path,
) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128)
    [output] = llm.generate(
        ["Once upon a time"], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=0)
    )
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(output.prompt_token_ids)
    assert all(
        len(entry) == 1 for entry in output.prompt_logprobs[1:] if entry is not None
    )  # k=0: the token alone
    assert len(output.outputs) == 3
