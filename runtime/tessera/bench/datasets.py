"""Workloads for the serving benchmark: each request has an exact prompt and output length."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # token ids give exact input lengths
    prompt_len: int
    output_len: int  # exact: sent with ignore_eos


def random_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Like vLLM's random dataset: uniform lengths in [len*(1-r), len*(1+r)], random non-special tokens,
    optionally behind a shared random prefix of `prefix_len` tokens."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    prefix = [rng.choice(vocab) for _ in range(prefix_len)]

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    requests = []
    for _ in range(num_prompts):
        n_in, n_out = length(input_len), length(output_len)
        prompt = prefix + [rng.choice(vocab) for _ in range(n_in)]
        requests.append(BenchRequest(prompt, len(prompt), n_out))
    return requests


def fixed_requests(tokenizer: Any, num_prompts: int, prompt: str, output_len: int) -> list[BenchRequest]:
    """The same text prompt every time, with an exact output length."""
    prompt_len = len(tokenizer(prompt).input_ids)
    return [BenchRequest(prompt, prompt_len, output_len) for _ in range(num_prompts)]
