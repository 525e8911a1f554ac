"""Attention over the paged KV cache, behind a small backend interface.

A backend does three things for one layer: write the step's new K/V into their slots, attend decode
tokens (one query each) through their block tables, and attend prefill chunks. The model calls only
these; the metadata they read is built once per step by the model runner.

KV cache layout, per layer: `[2, kv_heads, num_slots, head_dim]` with `slot = block * block_size +
offset`. Head-major, so that the blocks of a request gathered by block id come out as
`[kv_heads, batch, context, head_dim]`, and `K^T` for the score matmul is a free transpose of the
last two dimensions (the earlier slot-major layout made every attention matmul copy its operand
again). Block 0 is reserved and never allocated: padding of block tables points at it, and its
columns are masked out.

`PagedAttention` is the portable backend (CPU and CUDA, plain torch ops). Its bf16 decode gathers
whole blocks with one `index_select` per K and V (a memcpy of `block_size * head_dim` elements per
block and head), then one batched matmul / softmax / matmul with the query heads that share a KV
head folded into the rows. Requests are grouped by context length so that one long request does
not pad 63 short ones to its length. float32 keeps the reference SDPA kernel: it is the parity
path against transformers.

Sliding windows (Mistral, Gemma 2/3, ...): a window layer attends only the last `window` positions
(itself included: key j is seen by query i when i - window < j <= i, transformers' rule). The
window is in the masks, not in the backend: `windowed(meta, window)` rebuilds the step's masks
once per step and the window layers get that metadata, so every step kind (prefill chunks, mixed,
decode) is covered by the same code; Llama 4's chunked attention (a query attends only the keys in
its own `attention_chunk_size`-aligned chunk) is the same masks with another rule (`chunked`).
Soft-capping (Gemma 2) needs the scores between the matmuls,
so capped layers run the reference's eager attention (`_eager`) instead of SDPA; so do layers with
attention sinks (gpt-oss: a learned logit per head joins every softmax row and is dropped after it).

A quantized cache (`--kv-cache-dtype int8|fp8`, `baton.model.kv_quant`): rows are written as
codes and a scale; the native kernels read and write them in place (`kernels/paged_attention.cpp`),
and the torch path gathers them as bytes (decode multiplies the codes, prefill dequantizes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from baton.model.kv_quant import as_bytes, dequantize_rows, is_quantized, quantize_rows, split_rows


@dataclass
class PrefillSpan:
    """One prefill chunk of a request inside the flattened step."""

    start: int  # first token of the chunk in the flattened batch
    length: int  # tokens in the chunk (queries)
    context_len: int  # tokens attended: already-computed prefix + this chunk
    gather_slots: torch.Tensor | None  # [context_len] slots; None when the chunk is the whole context
    mask: torch.Tensor | None  # [1, 1, length, context_len] bool, True = attend; None when causal
    # the request's block table up to context_len ([ceil(context_len / block_size)]): for the
    # batch-invariant prefill, which attends each query as a decode step would (None: not built)
    block_ids: torch.Tensor | None = None
    block_size: int = 0


@dataclass
class DecodeGroup:
    """Decode requests of similar context length, attended as one padded batch."""

    start: int  # first of the group's tokens in the flattened step (decode tokens come first)
    count: int  # requests (= query tokens) in the group
    num_blocks: int  # padded block-table width: context padded to num_blocks * block_size
    block_ids: torch.Tensor  # [count * num_blocks] the block tables, flattened; padding -> block 0
    context_lens: torch.Tensor  # [count] int64 tokens attended by each request
    # for the padded torch path only (None when the native kernel runs):
    bias: torch.Tensor | None  # [1, count, 1, L] fp32 additive mask: 0 attend, -inf padding
    mask: torch.Tensor | None  # [count, 1, 1, L] bool, True = attend (the fp32 SDPA path)


@dataclass
class AttentionMetadata:
    """Built once per step; every layer reuses it (Python work per layer is the enemy at batch 1)."""

    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    decode_groups: list[DecodeGroup]  # the step's first tokens are decode tokens, one per request
    prefills: list[PrefillSpan]
    block_size: int


class PagedAttention:
    """Paged attention in plain torch ops (CPU and CUDA); bf16 CPU decode through the native
    in-place kernel (`baton.model.kernels`) when one was built."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 softcap: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale if scale is not None else head_dim**-0.5
        self.softcap = softcap  # scores -> tanh(scores / cap) * cap before the mask (Gemma 2)
        # [heads]: a logit per head in every softmax row (gpt-oss), set by the layer that owns it
        self.sinks: torch.Tensor | None = None
        self.paged_kernel: Any = None  # the compiled module; set by `use_native_kernel`
        self.decode_style_prefill = False  # set by `use_native_kernel` (batch-invariant mode)
        self.fused = False  # set by `use_native_kernel`: RoPE, KV write and attention in one call
        self.kv_dtype: torch.dtype | None = None  # int8 / fp8: a quantized cache (`use_kv_dtype`)

    def use_kv_dtype(self, dtype: torch.dtype) -> None:
        """Read and write the cache in `dtype` (int8 / fp8: quantized rows, which the native kernels
        read and write too)."""
        self.kv_dtype = dtype if is_quantized(dtype) else None

    def _gather(self, kv_cache: torch.Tensor, dim: int, index: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # kv_cache: [2, kv_heads, slots, w] (or a blocked view); K's and V's rows `index` along
        # `dim`, dequantized to `dtype` when the cache is quantized (K and V in one op each)
        if self.kv_dtype is None:
            return kv_cache[0].index_select(dim - 1, index), kv_cache[1].index_select(dim - 1, index)
        kv = dequantize_rows(as_bytes(kv_cache).index_select(dim, index).view(kv_cache.dtype), dtype)
        return kv[0], kv[1]

    def use_native_kernel(self, kernel: Any, decode_style_prefill: bool = False, fused: bool = True) -> None:
        """decode_style_prefill: attend every prefill query with the paged decode kernel, over its own
        causal context in the cache, so that a token's attention (and KV above layer 0) is the same
        number whether it was computed in a prefill chunk (any chunking, any batch) or in a decode
        step: a request recomputed from prompt + generated tokens (a takeover whose KV is missing
        from the store, a preemption) continues with the tokens it would have produced.
        fused=False: the kernel attends decode queries only; the layer's own ops make q and k (a
        family whose norms or rotary the fused call does not do: `CausalLM.prepare`)."""
        self.paged_kernel = kernel
        self.decode_style_prefill = decode_style_prefill and kernel is not None
        self.fused = fused and kernel is not None

    @property
    def pads_decode(self) -> bool:
        """Whether decode pays for padding to the group's longest context (then group by length)."""
        return self.paged_kernel is None

    @property
    def fuses_decode(self) -> bool:
        """Whether a decode-only step's RoPE, KV write and attention run as one native call (bf16 on
        the CPU with the kernels built; the kernel is attached only for bf16)."""
        return self.fused

    def rope_write_decode(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                          kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # qkv: [B, (heads + 2 kv_heads) * d] from the fused projection; cos, sin_signed: [B, 1, d];
        # kv_cache: [2, kv_heads, slots, d] -> [B, heads * d]. One decode group (decode-only step).
        group = meta.decode_groups[0]
        return self.paged_kernel.rope_write_decode(qkv, cos, sin_signed, kv_cache, meta.slot_mapping,
                                                   group.block_ids.view(group.count, -1), group.context_lens,
                                                   self.num_heads, meta.block_size, self.scale)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        # kv_cache: [2, kv_heads, slots, d (+ 4 when quantized)]; k, v: [T, kv_heads, d]
        if self.kv_dtype is not None:  # K and V quantized together, written in one op
            rows = as_bytes(quantize_rows(torch.stack([k, v]), self.kv_dtype))  # [2, T, kv_heads, d + 4]
            as_bytes(kv_cache).index_copy_(2, meta.slot_mapping, rows.transpose(1, 2))
            return
        kv_cache[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        kv_cache[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, block_size: int) -> torch.Tensor:
        # q: [B, heads, d] (this group's queries); kv_cache: [2, kv_heads, slots, d] -> [B, heads, d]
        kv_heads, d, batch = self.num_kv_heads, self.head_dim, group.count
        if self.paged_kernel is not None and q.dtype != torch.float32:
            return self.paged_kernel.paged_decode(q, kv_cache[0], kv_cache[1], group.block_ids.view(batch, -1),
                                                  group.context_lens, block_size, self.scale)
        blocks = kv_cache.view(2, kv_heads, -1, block_size, kv_cache.shape[-1])
        length = group.num_blocks * block_size
        if self.kv_dtype is not None and self.softcap is None and self.sinks is None and q.dtype != torch.float32:
            return self._decode_codes(q, blocks, group, length)
        k, v = self._gather(blocks, 2, group.block_ids, q.dtype)
        k, v = k.view(kv_heads, batch, length, d), v.view(kv_heads, batch, length, d)
        if self.softcap is not None or self.sinks is not None:
            out = _eager(q.unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1), group.mask, self.scale, self.softcap,
                         self.sinks)
            return out.squeeze(2)
        if q.dtype == torch.float32:
            # fp32 is the parity path: the same kernel the reference uses, on [B, kv_heads, L, d] views
            out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1),
                                                 attn_mask=group.mask, scale=self.scale, enable_gqa=True)
            return out.squeeze(2)
        # The query heads that share a KV head are rows of one matmul: [kv_heads, B, group, d].
        # (CPU SDPA with a mask in bf16 falls back to a path 25x slower than this at batch 16.)
        qg = q.view(batch, kv_heads, self.group, d).transpose(0, 1)
        scores = torch.matmul(qg, k.transpose(-1, -2))  # [kv_heads, B, group, L]
        scores = torch.add(group.bias, scores, alpha=self.scale)  # fp32: mask and scale in one op
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [kv_heads, B, group, d]
        return out.transpose(0, 1).reshape(batch, self.num_heads, d)

    def _decode_codes(self, q: torch.Tensor, blocks: torch.Tensor, group: DecodeGroup, length: int) -> torch.Tensor:
        # A quantized cache's decode: the matmuls read the codes (exact in bf16), and the scales
        # multiply the scores and the probabilities ([.., L], head_dim times smaller than K or V):
        # q.(s_t c_t) = s_t (q.c_t) and sum_t p_t (s_t c_t) = sum_t (p_t s_t) c_t.
        kv_heads, d, batch = self.num_kv_heads, self.head_dim, group.count
        rows = as_bytes(blocks).index_select(2, group.block_ids).view(blocks.dtype)  # [2, kv_heads, B*nb, bs, d+4]
        codes, scales = split_rows(rows, q.dtype)
        k, v = codes[0].view(kv_heads, batch, length, d), codes[1].view(kv_heads, batch, length, d)
        k_scale = scales[0].view(kv_heads, batch, 1, length)
        v_scale = scales[1].view(kv_heads, batch, 1, length)
        qg = q.view(batch, kv_heads, self.group, d).transpose(0, 1)  # [kv_heads, B, group, d]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float()  # [kv_heads, B, group, L]
        scores = torch.addcmul(group.bias, scores, k_scale, value=self.scale)
        probs = (torch.softmax(scores, dim=-1) * v_scale).to(v.dtype)
        out = torch.matmul(probs, v)  # [kv_heads, B, group, d]
        return out.transpose(0, 1).reshape(batch, self.num_heads, d)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                span: PrefillSpan) -> torch.Tensor:
        # q: [n, heads, d]; k, v: [n, kv_heads, d] (this chunk's, already written to the cache);
        # kv_cache: [2, kv_heads, slots, d] -> [n, heads, d]
        if self.decode_style_prefill and span.block_ids is not None and q.dtype != torch.float32:
            n = q.shape[0]
            first = span.context_len - n  # position of the chunk's first query
            lens = torch.arange(first + 1, span.context_len + 1, dtype=torch.long, device=q.device)
            table = span.block_ids.unsqueeze(0).expand(n, -1).contiguous()
            return self.paged_kernel.paged_decode(q, kv_cache[0], kv_cache[1], table, lens, span.block_size,
                                                  self.scale)
        qp = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if span.gather_slots is None:  # the chunk is the whole context: no cache read needed
            kp, vp = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        else:
            kp, vp = self._gather(kv_cache, 2, span.gather_slots, q.dtype)
            kp, vp = kp.unsqueeze(0), vp.unsqueeze(0)  # [1, kv_heads, ctx, d]
        if self.softcap is not None or self.sinks is not None:
            return _eager(qp, kp, vp, span.mask, self.scale, self.softcap, self.sinks).squeeze(0).transpose(0, 1)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask, is_causal=span.mask is None,
                                             scale=self.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's eager attention (transformers' `eager_attention_forward`), op for op.
    q: [B, heads, n, d]; k, v: [B, kv_heads, L, d]; mask: bool [B or 1, 1, n, L], True = attend, or
    None = causal over the last n keys; sinks: [heads] or None -> [B, heads, n, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # repeat_kv
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, heads, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    n, length = scores.shape[-2:]
    if mask is None:
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is not None:
        # gpt-oss's eager_attention_forward: the sink logit joins each row, the max is taken out, the
        # softmax runs, and the sink's column is dropped (so each row's weights sum to less than 1);
        # fp32 here whatever the dtype (the reference stays in the scores' dtype: equal in fp32)
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, n, -1).to(scores.dtype)
        combined = torch.cat([scores, sink], dim=-1).float()
        combined = combined - combined.max(dim=-1, keepdim=True).values
        return torch.matmul(torch.softmax(combined, dim=-1)[..., :-1].to(v.dtype), v)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def windowed(meta: AttentionMetadata, window: int, chunked: bool = False) -> AttentionMetadata:
    """The step's metadata with every mask narrowed to a sliding window of `window` positions
    (key j is attended by the query at position i when i - window < j <= i), or, `chunked`, to the
    query's own chunk of `window` positions (j // window == i // window, j <= i: Llama 4's chunked
    attention, transformers' chunked_overlay; never wider than the sliding window). Built once per step
    for all the window layers; the torch paths read only the masks, so this is all a window takes.
    Decode groups must carry their padded-path masks (a window model never runs the native kernel)."""
    groups = []
    for g in meta.decode_groups:
        if g.mask is None:
            raise ValueError("a sliding-window layer needs the torch decode path (masks), not the native kernel")
        length = g.num_blocks * meta.block_size
        j = torch.arange(length, device=g.context_lens.device).unsqueeze(0)  # [1, L]
        lens = g.context_lens.unsqueeze(1)  # [count, 1]; the query sits at lens - 1
        first = (lens - 1) // window * window if chunked else lens - window  # the first key attended
        attend = (j < lens) & (j >= first)  # [count, L]
        bias = torch.zeros(attend.shape, dtype=torch.float32, device=attend.device).masked_fill_(~attend, float("-inf"))
        groups.append(replace(g, mask=attend.view(g.count, 1, 1, length), bias=bias.view(1, g.count, 1, length)))
    spans = []
    for span in meta.prefills:
        if span.context_len <= window:
            spans.append(span)  # nothing is outside the window (the first chunk) yet: the causal mask is it
            continue
        first = span.context_len - span.length  # position of the chunk's first query
        device = span.mask.device if span.mask is not None else meta.slot_mapping.device
        keys = torch.arange(span.context_len, device=device).unsqueeze(0)  # [1, ctx]
        pos = torch.arange(first, span.context_len, device=device).unsqueeze(1)  # [n, 1]
        mask = (keys <= pos) & ((keys // window == pos // window) if chunked else (keys > pos - window))
        # batch-invariant decode-style prefill attends whole contexts: not for window layers
        spans.append(replace(span, mask=mask.view(1, 1, span.length, span.context_len), block_ids=None))
    return replace(meta, decode_groups=groups, prefills=spans)


def group_by_context(context_lens: list[int], block_size: int, overhead_tokens: int = 512) -> list[tuple[int, int]]:
    """Split decode requests, sorted by context length ascending, into contiguous groups.

    A group is padded to its longest member; each extra group costs a fixed number of ops per layer.
    Minimises  sum over groups of (overhead_tokens + count * padded max length)  by dynamic
    programming over the sorted lengths (O(n^2), n <= max_num_seqs). Returns (start, count) pairs.
    """
    n = len(context_lens)
    if n <= 1:
        return [(0, n)] if n else []
    padded = [-(-c // block_size) * block_size for c in context_lens]
    if padded[-1] * n <= sum(padded) + overhead_tokens:  # one group wastes less than a split costs
        return [(0, n)]
    best = [0.0] * (n + 1)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        width = padded[j - 1]
        best[j], cut[j] = min((best[i] + overhead_tokens + (j - i) * width, i) for i in range(j))
    groups = []
    j = n
    while j > 0:
        groups.append((cut[j], j - cut[j]))
        j = cut[j]
    return groups[::-1]
