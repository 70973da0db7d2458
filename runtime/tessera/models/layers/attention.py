"""Attention over a paged KV cache: prefill, chunked prefill and decode in one forward pass.

The cache of one layer is ``[2 (K/V), num_blocks, block_size, num_kv_heads, head_dim]``; a
sequence's tokens live in the blocks its block table lists. Each forward first writes the
new tokens' K/V at their slots, then attends:

- decodes (one query token each, first in the batch) in one batched call (or a few, grouping
  decodes of similar length when lengths vary): their blocks are gathered into a padded
  ``[B, L, kv_heads, head_dim]`` workspace and masked by length. GQA costs nothing: a
  decode's query heads that share a KV head are fed as that head's query rows, so no key is
  repeated.
- prefills one sequence at a time: a fresh prompt attends to its own new K/V causally; a
  chunk whose earlier context is cached (chunked prefill, prefix-cache hit) gathers the
  context and uses a causal mask offset by the cached length.

Everything that depends only on the batch layout (block ids, masks) is computed once per
forward in ``AttentionPlan`` and shared by every layer.

On CUDA the Triton kernels (``triton_attention.py``, ``tessera.kernels.triton``) replace all
of the above the same way: they write the new K/V and attend straight from the blocks, decodes
split over the context, every prefill in one launch. ``TESSERA_ATTENTION_BACKEND=triton``
selects them on any device (on CPU under Triton's interpreter, for tests).

On CPU the native kernel (``tessera.kernels``) replaces all of the above: it writes the new
K/V and attends every sequence straight from its blocks with an online softmax, no gather,
no mask, no padding. The ATen formulation stays for other devices and as the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tessera.kernels import native_ops
from tessera.models.layers.triton_attention import TritonAttentionPlan, uses_triton


@dataclass
class AttentionMetadata:
    slot_mapping: (
        torch.Tensor
    )  # [N] int64: flat cache slot (block_id * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B+1] int64 (CPU): tokens of seq i are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] int64 (CPU): context length of each seq after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64: block ids of each seq, padded with 0
    num_decodes: int  # the first num_decodes seqs have exactly one query token
    max_seq_len: int
    query_start_loc_list: list[int]
    seq_lens_list: list[int]


class GatherWorkspace:
    """One growing buffer reused by every layer's gather (allocating fresh tens of MB per
    layer costs page faults that can exceed the copy itself)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(numel, int(numel * 1.25)), dtype=dtype, device=device)
            self._buffer = buf
        return buf[:numel]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefillSpan:
    """One prefilling sequence: its query rows and, when earlier tokens are cached, where they are."""

    q_start: int
    q_end: int
    context_len: int  # all tokens it attends to, cached + new
    block_ids: torch.Tensor | None  # blocks holding the context; None when the query is the whole context

    @property
    def query_len(self) -> int:
        return self.q_end - self.q_start


# Decodes are gathered padded to the longest one in their group. Grouping decodes of similar
# length (sorted, equal-count groups) keeps that padding small when lengths vary; groups below
# this size are not worth an extra gather and attention call per layer.
MIN_DECODE_GROUP = 8
MAX_DECODE_GROUPS = 4


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # decode rows in this group (device); None: all decodes, in order
    size: int
    blocks: int  # blocks gathered per decode (the group's longest)
    block_ids: torch.Tensor  # [size * blocks] flattened block table slice (device)
    lens: torch.Tensor  # [size] context lengths (device)


def _group_decodes(lens: list[int]) -> list[list[int]] | None:
    """Decode indices split into groups of similar length, or None for one group in batch order."""
    count = min(MAX_DECODE_GROUPS, len(lens) // MIN_DECODE_GROUP)
    if count < 2:
        return None
    order = sorted(range(len(lens)), key=lens.__getitem__)
    bounds = [len(order) * g // count for g in range(count + 1)]
    groups = [order[bounds[g] : bounds[g + 1]] for g in range(count)]
    padded = sum(len(group) * lens[group[-1]] for group in groups)
    # Not worth the extra calls when lengths are already uniform.
    return groups if padded < 0.85 * len(lens) * max(lens) else None


@dataclass
class AttentionPlan:
    metadata: AttentionMetadata
    slot_mapping: torch.Tensor
    block_size: int
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    workspace: GatherWorkspace
    native: ModuleType | None = None  # the CPU kernels, when they run this forward
    triton: TritonAttentionPlan | None = None  # the Triton kernels, when they run this forward
    _masks: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(
        cls, md: AttentionMetadata, block_size: int, device: torch.device, workspace: GatherWorkspace
    ) -> AttentionPlan:
        if uses_triton(device):
            triton = TritonAttentionPlan.build(
                md.slot_mapping,
                md.block_tables,
                md.seq_lens,
                md.query_start_loc,
                md.query_start_loc_list,
                md.seq_lens_list,
                md.num_decodes,
                device,
            )
            return cls(md, triton.slot_mapping, block_size, md.num_decodes, [], [], workspace, triton=triton)
        native = native_ops(device)
        if native is not None:
            return cls(md, md.slot_mapping, block_size, md.num_decodes, [], [], workspace, native)
        qsl, lens = md.query_start_loc_list, md.seq_lens_list
        num_decodes = md.num_decodes
        decode_groups = []
        if num_decodes:
            groups = _group_decodes(lens[:num_decodes])
            for group in groups or [list(range(num_decodes))]:
                blocks = _cdiv(max(lens[i] for i in group), block_size)
                if groups is None:
                    rows, table, group_lens = None, md.block_tables[:num_decodes], md.seq_lens[:num_decodes]
                else:
                    index = torch.tensor(group, dtype=torch.int64)
                    table = md.block_tables.index_select(0, index.to(md.block_tables.device))
                    group_lens = md.seq_lens.index_select(0, index)
                    rows = index.to(device, non_blocking=True)
                decode_groups.append(
                    DecodeGroup(
                        rows=rows,
                        size=len(group),
                        blocks=blocks,
                        block_ids=table[:, :blocks].reshape(-1).to(device, non_blocking=True),
                        lens=group_lens.to(device, non_blocking=True),
                    )
                )
        prefills = []
        for i in range(num_decodes, len(lens)):
            q_start, q_end, context = qsl[i], qsl[i + 1], lens[i]
            if q_end == q_start:
                continue
            ids = None
            if context != q_end - q_start:
                ids = md.block_tables[i, : _cdiv(context, block_size)].to(device)
            prefills.append(PrefillSpan(q_start, q_end, context, ids))
        return cls(
            metadata=md,
            slot_mapping=md.slot_mapping.to(device),
            block_size=block_size,
            num_decodes=num_decodes,
            decode_groups=decode_groups,
            prefills=prefills,
            workspace=workspace,
        )

    def decode_mask(self, index: int, group: DecodeGroup, sliding_window: int | None) -> torch.Tensor:
        """[D, 1, 1, L] bool: key l of decode d is visible iff l < len_d (and inside the window)."""
        key = ("decode", index, sliding_window)
        if key not in self._masks:
            lens = group.lens[:, None]
            keys = torch.arange(group.blocks * self.block_size, device=lens.device)[None, :]
            mask = keys < lens
            if sliding_window is not None:
                mask &= keys >= lens - sliding_window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, index: int, span: PrefillSpan, sliding_window: int | None) -> torch.Tensor | None:
        """[q, context] bool: query t sees keys [.., context - q + t]; None means plain causal."""
        window_matters = sliding_window is not None and sliding_window < span.context_len
        if span.block_ids is None and not window_matters:
            return None
        key = ("prefill", index, sliding_window)
        if key not in self._masks:
            device = self.slot_mapping.device
            query_pos = torch.arange(span.query_len, device=device)[:, None] + (
                span.context_len - span.query_len
            )
            keys = torch.arange(span.context_len, device=device)[None, :]
            mask = keys <= query_pos
            if sliding_window is not None and window_matters:
                mask &= keys > query_pos - sliding_window
            self._masks[key] = mask
        return self._masks[key]


class Attention(nn.Module):
    """Scaled dot-product attention of this rank's heads against the paged cache of one layer."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"attention softcap must be positive, not {softcap}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        # Scores soft-capped before the softmax, softcap * tanh(score / softcap) (Gemma 2).
        self.softcap = softcap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """q: [N, heads*head_dim], k/v: [N, kv_heads*head_dim] -> [N, heads*head_dim].

        Rows may be strided (views into the fused QKV output)."""
        if plan.triton is not None:
            return plan.triton.attend(
                q, k, v, kv_cache, self.num_heads, self.scale, self.sliding_window, self.softcap or 0.0
            )
        if plan.native is not None:
            md = plan.metadata
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            plan.native.paged_attention(
                out,
                q,
                k,
                v,
                kv_cache,
                md.slot_mapping,
                md.block_tables,
                md.seq_lens,
                md.query_start_loc,
                self.scale,
                self.sliding_window or 0,
                self.softcap or 0.0,
            )
            return out
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        slots = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        slots[0].index_copy_(0, plan.slot_mapping, k)
        slots[1].index_copy_(0, plan.slot_mapping, v)

        out = torch.empty_like(q)
        for index, group in enumerate(plan.decode_groups):
            if group.rows is None:
                out[: group.size] = self._decode(q[: group.size], index, group, kv_cache, plan)
            else:
                attended = self._decode(q.index_select(0, group.rows), index, group, kv_cache, plan)
                out.index_copy_(0, group.rows, attended)
        for index, span in enumerate(plan.prefills):
            out[span.q_start : span.q_end] = self._prefill(index, span, q, k, v, kv_cache, plan)
        return out.view(n, self.num_heads * self.head_dim)

    def _decode(
        self, q: torch.Tensor, index: int, group: DecodeGroup, kv_cache: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        d, kvh, hd = q.shape[0], self.num_kv_heads, self.head_dim
        length = group.blocks * plan.block_size
        gathered = plan.workspace.take(2 * d * length * kvh * hd, kv_cache.dtype, kv_cache.device)
        gathered = gathered.view(2, d * group.blocks, plan.block_size, kvh, hd)
        torch.index_select(kv_cache, 1, group.block_ids, out=gathered)
        keys_values = gathered.view(2, d, length, kvh, hd).transpose(2, 3)  # [2, D, kvh, L, hd]
        # The `group` query heads of one KV head act as that head's query rows: same keys, same mask.
        grouped_q = q.view(d, kvh, self.group, hd)
        mask = plan.decode_mask(index, group, self.sliding_window)
        if self.softcap is not None:
            attended = self._softcapped(grouped_q, keys_values[0], keys_values[1], mask)
            return attended.reshape(d, self.num_heads, hd)
        attended = F.scaled_dot_product_attention(
            grouped_q,
            keys_values[0],
            keys_values[1],
            attn_mask=mask,
            scale=self.scale,
        )
        return attended.reshape(d, self.num_heads, hd)

    def _prefill(
        self,
        index: int,
        span: PrefillSpan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        # [1, heads, q, hd]: SDPA's fused kernels (flash, memory-efficient) take 4-D inputs only;
        # given 3-D, CUDA falls back to the math kernel, which writes out every score.
        query = q[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
        if span.block_ids is None:
            keys = k[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
            values = v[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
        else:
            blocks = kv_cache.index_select(1, span.block_ids)
            context = blocks.view(2, -1, self.num_kv_heads, self.head_dim)[:, : span.context_len]
            keys, values = context[0].transpose(0, 1).unsqueeze(0), context[1].transpose(0, 1).unsqueeze(0)
        mask = plan.prefill_mask(index, span, self.sliding_window)
        if self.softcap is not None:
            if self.group > 1:
                keys, values = keys.repeat_interleave(self.group, 1), values.repeat_interleave(self.group, 1)
            return self._softcapped(query, keys, values, mask)[0].transpose(0, 1)
        gqa = self.group > 1
        if gqa and mask is not None and query.is_cuda:
            # With a mask only the memory-efficient kernel is fused, and it takes no GQA: the KV
            # heads are shared out (the context once per query head, far less than its scores).
            keys, values = keys.repeat_interleave(self.group, 1), values.repeat_interleave(self.group, 1)
            gqa = False
        attended = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=gqa,
        )
        return attended[0].transpose(0, 1)

    def _softcapped(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention with soft-capped scores, written out (SDPA has no soft-capping): [.., q, hd]
        queries against [.., L, hd] keys and values of as many heads; ``mask`` [.., q, L] bool,
        None for causal with the queries last."""
        assert self.softcap is not None
        scores = torch.matmul(query, keys.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            q_len, k_len = scores.shape[-2:]
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), values)
