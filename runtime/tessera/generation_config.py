"""What a model's generation_config.json asks of generation: its EOS ids and its sampling defaults.

vLLM applies a model's sampling defaults (``--generation-config auto``, its default) to every
parameter a request leaves unset: a Llama 3 Instruct model samples at temperature 0.6 and
top_p 0.9 unless told otherwise, and its ``max_new_tokens`` caps every request's max_tokens.
Tessera does the same, so the same request gets the same sampling from either server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

FILE_NAME = "generation_config.json"
# generation_config.json's name for a default that SamplingParams calls otherwise.
_RENAMED = {"max_new_tokens": "max_tokens"}


class SamplingDefaults(BaseModel):
    """The sampling parameters a model may set defaults for (vLLM's list), each None when unset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    max_tokens: int | None = Field(None, ge=1)

    def cap(self, max_tokens: int | None) -> int | None:
        """A request's max_tokens within the model's own cap (vLLM: the smaller of the two)."""
        if self.max_tokens is None:
            return max_tokens
        return self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)

    def set_fields(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def eos_token_ids(model_dir: Path) -> list[int]:
    """EOS ids from generation_config.json (some models stop on several)."""
    eos = _read(model_dir / FILE_NAME).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def sampling_defaults_of(data: dict[str, Any], source: str) -> SamplingDefaults:
    """The sampling defaults among a generation config's keys (the rest, e.g. do_sample, are not
    vLLM's to apply either); a value out of its parameter's bounds is an error naming ``source``."""
    names = set(SamplingDefaults.model_fields)
    picked = {_RENAMED.get(key, key): value for key, value in data.items() if _RENAMED.get(key, key) in names}
    try:
        return SamplingDefaults(**{key: value for key, value in picked.items() if value is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{source} holds invalid sampling defaults: {problems}") from exc


def load_sampling_defaults(
    model_dir: Path, generation_config: str = "auto", overrides: dict[str, Any] | None = None
) -> SamplingDefaults:
    """``auto``: the model's own file; ``vllm``: none (the engine's defaults); otherwise a folder
    holding a generation_config.json. ``overrides`` (vLLM's ``--override-generation-config``)
    win over the file, key by key."""
    defaults = SamplingDefaults()
    if generation_config != "vllm":
        path = (model_dir if generation_config == "auto" else Path(generation_config)) / FILE_NAME
        if generation_config != "auto" and not path.is_file():
            raise ValueError(f"generation_config: {path} does not exist")
        defaults = sampling_defaults_of(_read(path), str(path))
    if overrides:
        defaults = SamplingDefaults(**(defaults.set_fields() | parse_overrides(overrides).set_fields()))
    return defaults


def parse_overrides(overrides: dict[str, Any]) -> SamplingDefaults:
    """vLLM's ``--override-generation-config`` JSON, its keys checked (a typo must not pass unseen)."""
    unknown = sorted(set(overrides) - set(SamplingDefaults.model_fields) - set(_RENAMED))
    if unknown:
        raise ValueError(
            f"override_generation_config: unknown sampling default(s) {unknown}; "
            f"known: {sorted(SamplingDefaults.model_fields)}"
        )
    return sampling_defaults_of(overrides, "override_generation_config")
