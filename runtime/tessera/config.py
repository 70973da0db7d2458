"""Engine configuration: one pydantic model shared by the offline API, the CLI and the server."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="alias (e.g. smollm2-135m-instruct), local Hugging Face folder, or .gguf file"
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    max_model_len: int | None = Field(None, ge=1, description="default: the model's context length")
    max_num_seqs: int = Field(128, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    block_size: int = Field(16, ge=1)
    kv_cache_memory: int | None = Field(None, ge=1, description="bytes for the KV cache of this rank")
    num_kv_blocks: int | None = Field(None, ge=1, description="overrides kv_cache_memory")
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(0, ge=0, description="0: no per-request cap per step")
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(None, ge=1, description="torch threads per rank process")
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    sequence_parallel: bool = False
    layer_partition: list[int] | None = None

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError("max_num_batched_tokens must be >= max_model_len when chunked prefill is off")
        if self.sequence_parallel and self.tensor_parallel_size < 2:
            raise ValueError("sequence_parallel needs tensor_parallel_size > 1")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
