"""Triton kernels over Baton's paged KV cache (issue 43): the KV write, decode and prefill attention.

They read and write the cache in place, in its own layout (see `baton.model.attention`): per layer
`[2, kv_heads, num_slots, head_dim]`, `slot = block * block_size + offset`. A key's slot is
computed from the request's block table inside the kernel, so nothing is gathered into a
contiguous copy first (the torch path's cost on a GPU: one gather of every request's KV per layer
per step).

- `write_kv`: a step's new K/V rows into their slots (a negative slot is skipped: padding rows).
- `paged_decode`: one query row per request, the query heads of a KV head together (GQA), the
  context split into `num_splits` ranges attended by separate programs and then reduced
  (flash-decoding), so that one long request still fills the GPU. Optional sliding window, logit
  soft-capping and attention sinks; fp32 running max / sum / accumulator.
- `paged_prefill`: varlen over a batch of chunks; each chunk's queries attend the request's cached
  prefix and the chunk itself (already written to the cache) through the block table, causally
  (and within the window), in tiles of queries x keys with an online softmax.

Every kernel also runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is
imported) on CPU tensors: that is how the test suite checks them without a GPU
(tests/test_triton_kernels.py). Importing this module requires triton; callers go through
`baton.model.triton_attention`, which imports it only when triton is there.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Keys per inner-loop tile. 16 is the smallest tile `tl.dot` takes; decode uses it too so that its
# per-program register tile (group x keys x head_dim) stays small at head_dim 256.
_BLOCK_N = 16
_BLOCK_M = 16  # prefill queries per program

# Triton 3.9's interpreter computes `tl.dot` of bf16 operands wrongly (it multiplies the raw bits):
# under it, the prefill kernel widens its operands to fp32 before the dots. So the interpreter
# checks a bf16 cache's indexing, masking and softmax, and the bf16 tensor-core dots are checked on
# a GPU only.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ckv, stride_ch, stride_cs,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    # a negative slot (a padded row of a captured batch) writes nothing
    dm = d < tl.where(slot >= 0, HEAD_DIM, 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm)
    dst = cache_ptr + h * stride_ch + slot * stride_cs + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=dm)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _tanh(x):
    # tanh through the sigmoid (portable across Triton versions and the interpreter)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _load_kv_tile(cache_ptr, table_ptr, row, pos, pm, kvh, d, dm,
                  stride_ckv, stride_ch, stride_cs, stride_tb, block_size):
    # K and V of positions `pos` (masked by `pm`) of request `row`, read in place through its block
    # table: slot = block * block_size + offset. [BLOCK_N, BLOCK_D] each, in the cache's dtype.
    block = tl.load(table_ptr + row * stride_tb + pos // block_size, mask=pm, other=0).to(tl.int64)
    slot = block * block_size + pos % block_size
    k_ptrs = cache_ptr + kvh * stride_ch + slot[:, None] * stride_cs + d[None, :]
    kv_mask = pm[:, None] & dm[None, :]
    return tl.load(k_ptrs, mask=kv_mask, other=0.0), tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0)


@triton.jit
def _decode_split_kernel(q_ptr, cache_ptr, table_ptr, lens_ptr,
                         part_acc_ptr, part_m_ptr, part_l_ptr,
                         stride_qb, stride_qh, stride_ckv, stride_ch, stride_cs, stride_tb,
                         scale, softcap, window, block_size, split_len,
                         NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    # One program: request b, KV head kvh (all GROUP query heads sharing it), context range s.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    # the query sits at ctx - 1 and sees keys j > ctx - 1 - window (window 0: all of them)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    start = lo + s * split_len
    end = tl.minimum(start + split_len, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gm = g < GROUP
    dm = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < end
        k, v = _load_kv_tile(cache_ptr, table_ptr, b, pos, pm, kvh, d, dm,
                             stride_ckv, stride_ch, stride_cs, stride_tb, block_size)
        k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_N]
        if HAS_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        scores = tl.where(pm[None, :], scores, float("-inf"))
        # every tile holds at least one key (n0 < end), so m_new is finite
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    # partials [B, heads, NUM_SPLITS, (d)]: unnormalised acc, running max and sum (an empty range
    # leaves m = -inf, l = 0, acc = 0: the reduction weighs it zero)
    row = (b * NUM_HEADS + heads) * NUM_SPLITS + s  # [BLOCK_G]
    tl.store(part_m_ptr + row, m_i, mask=gm)
    tl.store(part_l_ptr + row, l_i, mask=gm)
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gm[:, None] & dm[None, :])


@triton.jit
def _decode_reduce_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, out_ptr, stride_ob, stride_oh,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = s < NUM_SPLITS
    row = (b * NUM_HEADS + h) * NUM_SPLITS + s
    m = tl.load(part_m_ptr + row, mask=sm, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=sm, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=sm[:, None] & (d < HEAD_DIM)[None, :],
                  other=0.0)
    m_max = tl.max(m, axis=0)  # finite: split 0 always holds the query's own key
    if HAS_SINKS:  # the head's sink logit joins the softmax's denominator only (gpt-oss)
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    w = tl.exp(m - m_max)  # 0 for empty splits
    denominator = tl.sum(w * l, axis=0)
    if HAS_SINKS:
        denominator += tl.exp(sink - m_max)
    out = tl.sum(w[:, None] * acc, axis=0) / denominator
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, table_ptr, q_starts_ptr, q_lens_ptr, ctx_lens_ptr, sinks_ptr, out_ptr,
                    stride_qt, stride_qh, stride_ckv, stride_ch, stride_cs, stride_tb, stride_ot, stride_oh,
                    scale, softcap, window, block_size,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                    FP32_DOT: tl.constexpr):
    # One program: BLOCK_M queries of chunk `seq`, one query head.
    mt = tl.program_id(0)
    seq = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_len = tl.load(q_lens_ptr + seq)
    ctx = tl.load(ctx_lens_ptr + seq)
    q0 = tl.load(q_starts_ptr + seq)
    first = ctx - q_len  # position of the chunk's first query (= cached prefix length)

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < q_len
    pos_q = first + rows
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    q = tl.load(q_ptr + (q0 + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rm[:, None] & dm[None, :], other=0.0)

    # keys this tile of queries can see: up to its last query's position (causal), and from its
    # first query's window start; a tile past the chunk's end gets an empty range
    hi = tl.minimum(ctx, first + mt * BLOCK_M + BLOCK_M)
    hi = tl.where(mt * BLOCK_M < q_len, hi, 0)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first + mt * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < hi
        k, v = _load_kv_tile(cache_ptr, table_ptr, seq, pos, pm, kvh, d, dm,
                             stride_ckv, stride_ch, stride_cs, stride_tb, block_size)
        if FP32_DOT:  # fp32: the exact products (the parity path), not TF32
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N] fp32
        if HAS_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        attend = pm[None, :] & (pos[None, :] <= pos_q[:, None])
        if HAS_WINDOW:
            attend = attend & (pos[None, :] > pos_q[:, None] - window)
        scores = tl.where(attend, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # a row with nothing visible yet in this tile keeps m = -inf: shift by 0 instead (no NaN)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if HAS_SINKS:  # the head's sink logit joins each row's denominator only (gpt-oss)
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_all = tl.maximum(m_i, sink)
        correction = tl.exp(m_i - m_all)
        acc = acc * correction[:, None]
        l_i = l_i * correction + tl.exp(sink - m_all)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past the chunk (not stored)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q0 + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(f"expected a layer's cache [2, kv_heads, slots, head_dim] with unit last stride, "
                         f"got {tuple(kv_cache.shape)} strides {kv_cache.stride()}")


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, kv_heads, slots, d]; k, v: [T, kv_heads, d]; slot_mapping: [T] (negative: skip)."""
    _check_cache(kv_cache)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    k, v = k.contiguous() if k.stride(-1) != 1 else k, v.contiguous() if v.stride(-1) != 1 else v
    _write_kv_kernel[(tokens, kv_heads)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim))


def decode_splits(max_context: int, batch: int, kv_heads: int, target_programs: int = 256,
                  max_splits: int = 32) -> int:
    """How many context ranges to split a decode step into: enough programs to fill the GPU
    (`target_programs`, about 2 per SM) when the batch alone does not, never a range under 256 keys."""
    programs = max(batch * kv_heads, 1)
    by_occupancy = -(-target_programs // programs)
    by_length = max(max_context // 256, 1)
    return max(1, min(by_occupancy, by_length, max_splits))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int, scale: float, max_context: int, softcap: float | None = None,
                 window: int | None = None, num_splits: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, heads, d]; kv_cache: [2, kv_heads, slots, d]; block_tables: [B, max_blocks];
    context_lens: [B] (keys attended, the query's own included); max_context: an upper bound on
    context_lens known on the host (no device sync); sinks: [heads] logits that join every softmax
    row's denominator (gpt-oss) or None -> [B, heads, d] in q's dtype."""
    _check_cache(kv_cache)
    batch, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    span = min(max_context, window) if window else max_context  # keys a request attends, at most
    splits = num_splits or decode_splits(span, batch, kv_heads)
    split_len = -(-max(span, 1) // splits)
    split_len = -(-split_len // _BLOCK_N) * _BLOCK_N
    part_acc = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, kv_cache, block_tables, context_lens, part_acc, part_m, part_l,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_tables.stride(0),
        scale, softcap or 0.0, window or 0, block_size, split_len,
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 2),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=_BLOCK_N, NUM_SPLITS=splits,
        HAS_SOFTCAP=bool(softcap))
    _decode_reduce_kernel[(batch, num_heads)](
        part_acc, part_m, part_l, sinks if sinks is not None else part_m, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
        BLOCK_S=max(triton.next_power_of_2(splits), 2), HAS_SINKS=sinks is not None)
    return out


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
                  q_lens: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float, max_q_len: int,
                  softcap: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen causal attention of a batch of chunks over their cached contexts.

    q: [T, heads, d] (the chunks' queries, chunk i at rows q_starts[i] .. + q_lens[i]); kv_cache:
    [2, kv_heads, slots, d] with every chunk's own K/V already written; block_tables: [N, max_blocks];
    context_lens: [N] prefix + chunk; max_q_len: a host-side bound on q_lens; sinks: as for
    `paged_decode` -> out [T, heads, d]
    (rows of q outside every chunk are left as they were in `out`)."""
    _check_cache(kv_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    num_seqs = q_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    grid = (triton.cdiv(max_q_len, _BLOCK_M), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, kv_cache, block_tables, q_starts, q_lens, context_lens, sinks if sinks is not None else q_lens, out,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale, softcap or 0.0, window or 0, block_size,
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
        HAS_SOFTCAP=bool(softcap), HAS_WINDOW=bool(window), HAS_SINKS=sinks is not None,
        FP32_DOT=q.dtype == torch.float32 or _INTERPRETED)
    return out
