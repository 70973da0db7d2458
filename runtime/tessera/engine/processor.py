"""Prompts in: tokenization, chat templates, validation, and fan-out of n samples."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tessera.engine.messages import EngineCoreRequest
from tessera.sampling_params import SamplingParams


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir))


def generation_eos_token_ids(model_dir: Path) -> list[int]:
    """EOS ids from generation_config.json (some models stop on several)."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        eos_token_id: int | None = None,
        extra_eos_token_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.extra_eos_token_ids = [t for t in (extra_eos_token_ids or []) if t != self.eos_token_id]
        self.vocab_size = len(tokenizer)

    @classmethod
    def from_model_dir(cls, model_dir: Path, max_model_len: int) -> InputProcessor:
        tokenizer = load_tokenizer(model_dir)
        return cls(tokenizer, max_model_len, extra_eos_token_ids=generation_eos_token_ids(model_dir))

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        assert isinstance(text, str)
        return text

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but this model's maximum context length is "
                f"{self.max_model_len} (prompt plus at least one generated token)"
            )
        return token_ids

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine request per sample: n>1 fans out to children with derived seeds."""
        if self.extra_eos_token_ids and not params.ignore_eos:
            params = replace(params, stop_token_ids=params.stop_token_ids + self.extra_eos_token_ids)
        arrival = time.time() if arrival_time is None else arrival_time
        return [
            EngineCoreRequest(
                request_id=child_request_id(request_id, index, params.n),
                prompt_token_ids=prompt_token_ids,
                sampling_params=params.for_child(index) if params.n > 1 else params,
                eos_token_id=self.eos_token_id,
                arrival_time=arrival,
            )
            for index in range(params.n)
        ]
