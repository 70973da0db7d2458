"""A minimal paged-cache driver for model tests: allocates blocks (deliberately scattered),
builds AttentionMetadata for a step, and runs the model. Not the engine's KV cache manager:
just enough bookkeeping to put the model through prefill, decode, chunked prefill and
prefix-cache hits the way the engine does."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tessera.models.layers.attention import AttentionMetadata


@dataclass
class SequenceState:
    tokens: list[int]  # every token the sequence has had computed (the context)
    blocks: list[int] = field(default_factory=list)


class PagedDriver:
    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        layers, kv_heads, head_dim = model.kv_cache_spec
        dtype = next(model.parameters()).dtype
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(layers)
        ]
        # Block 0 stays unused (it is the block-table padding value); the rest come out shuffled,
        # so no sequence gets contiguous blocks.
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[str, SequenceState] = {}

    def add(self, name: str, share_prefix_with: str | None = None, shared_blocks: int = 0) -> None:
        """A new sequence; optionally starting with another's first full blocks (a prefix-cache hit)."""
        state = SequenceState(tokens=[])
        if share_prefix_with is not None:
            other = self.seqs[share_prefix_with]
            if len(other.tokens) < shared_blocks * self.block_size:
                raise ValueError("only full blocks are shared (a partial block is still being written)")
            state.blocks = other.blocks[:shared_blocks]
            state.tokens = other.tokens[: shared_blocks * self.block_size]
        self.seqs[name] = state

    def step(self, work: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run one forward over (sequence, new tokens) pairs; returns logits of every new token."""
        input_ids, positions, metadata = self.prepare(work)
        self.last_metadata = metadata
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)
            return self.model.compute_logits(hidden)

    def prepare(
        self, work: list[tuple[str, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Allocate blocks for the new tokens and describe the step as the engine would."""
        input_ids, positions, slots = [], [], []
        query_start, seq_lens, tables = [0], [], []
        num_decodes, decoding = 0, True
        for name, new in work:
            state = self.seqs.setdefault(name, SequenceState(tokens=[]))
            start = len(state.tokens)
            is_decode = len(new) == 1 and start > 0
            if is_decode and decoding:
                num_decodes += 1
            elif is_decode:
                raise ValueError("decodes must come first in a batch")
            else:
                decoding = False
            total = start + len(new)
            while len(state.blocks) * self.block_size < total:
                state.blocks.append(self.free.pop())
            for pos in range(start, total):
                slots.append(state.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += new
            positions += list(range(start, total))
            state.tokens += new
            query_start.append(query_start[-1] + len(new))
            seq_lens.append(total)
            tables.append(list(state.blocks))
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=block_tables,
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens),
            query_start_loc_list=query_start,
            seq_lens_list=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64)
        return ids, torch.tensor(positions, dtype=torch.int64), metadata
