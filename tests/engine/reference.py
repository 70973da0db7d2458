"""The independent reference: transformers' own forward pass and greedy generate."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | list[int] | None
):
    """Greedy continuation of each prompt, one at a time (no padding), stopping at EOS like HF does."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_token_id,
                pad_token_id=eos_token_id if isinstance(eos_token_id, int) else 0,
            )
            results.append(out[0, len(prompt) :].tolist())
    return results


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1] float32: each prompt token's logprob given the tokens before it."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
