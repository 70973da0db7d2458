"""Engine configuration: one pydantic model shared by the offline API, the CLI and the server."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessera.generation_config import parse_overrides
from tessera.topology import ParallelLayout

# A CPU list as taskset takes it: 0-3,8.
CPU_LIST = r"\d+(-\d+)?(,\d+(-\d+)?)*"


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
    cpu_binding: str = Field(
        "none",
        pattern=rf"^(auto|none|{CPU_LIST})$",
        description="pin torch threads one per CPU: none, auto (in Tessera's own processes that own "
        "exactly their CPUs), or a CPU list such as 0-3",
    )
    retain_freed_memory: bool = Field(
        True,
        description="CPU ranks: glibc's malloc keeps freed memory for the next step instead of "
        "returning it to the OS (no page faults on every step's activations)",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="GPU ranks: the share of the device's memory the engine may use (weights, a step's "
        "peak, the KV cache), as vLLM's flag; the cache gets what a profiled step leaves",
    )
    generation_config: str = Field(
        "auto",
        min_length=1,
        description="sampling defaults for what a request leaves unset: auto (the model's "
        "generation_config.json, as vLLM), vllm (the engine's own: temperature 1, no top-p/top-k), "
        "or a folder holding a generation_config.json",
    )
    override_generation_config: dict[str, int | float] | None = Field(
        None,
        description='sampling defaults over the generation config, as JSON: {"temperature": 0.5}',
    )
    enforce_eager: bool = Field(
        False,
        description="CUDA ranks: run every step eagerly, capturing no CUDA graphs for decode batches "
        "(vLLM's flag)",
    )
    cuda_graph_sizes: list[int] | None = Field(
        None,
        description="the padded decode batch sizes captured as CUDA graphs (default: 1, 2, 4, then "
        "multiples of 8 up to max_num_seqs, at most 512)",
    )
    parallel: ParallelLayout = Field(default_factory=ParallelLayout)
    max_batches_in_flight: int | None = Field(
        None, ge=1, description="batches the engine keeps in flight (default: one per pipeline stage)"
    )

    @model_validator(mode="before")
    @classmethod
    def _lift_parallel_fields(cls, data: Any) -> Any:
        """Accept vLLM's flat keywords (``LLM(model, tensor_parallel_size=2)``) as the nested layout."""
        if isinstance(data, dict) and any(name in data for name in ParallelLayout.model_fields):
            data = dict(data)
            parallel = dict(data.pop("parallel", None) or {})
            for name in ParallelLayout.model_fields:
                if name in data:
                    parallel[name] = data.pop(name)
            data["parallel"] = parallel
        return data

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError("max_num_batched_tokens must be >= max_model_len when chunked prefill is off")
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1
        ):
            raise ValueError(f"cuda_graph_sizes {self.cuda_graph_sizes} must be batch sizes of 1 or more")
        if self.override_generation_config:
            parse_overrides(self.override_generation_config)
        return self

    @property
    def world_size(self) -> int:
        return self.parallel.world_size
