"""The Triton paged-attention kernels (baton/model/triton_kernels.py) against attention written from
first principles: softmax(Q K^T * scale [soft-capped] [+ mask]) V over each request's keys, read
from the paged cache by position -> slot.

Without a GPU they run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here
before the kernels' module is imported); on a CUDA machine (scripts/gpu_check.sh) the same tests
run the compiled kernels. The shapes are tiny because the interpreter is slow.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # too late to switch to the interpreter: say so instead of failing inside triton
        raise RuntimeError("triton was imported before tests/test_triton_kernels.py could set TRITON_INTERPRET=1: "
                           "run with TRITON_INTERPRET=1 in the environment")
    # read when triton (its own standard-library functions too) and the kernels are decorated, on
    # import, so before the first `import triton` of the process, and again at every launch: it
    # stays set for the session (nothing else in the suite imports triton on a CPU)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", exc_type=ImportError,
                    reason="triton is not installed or does not import "
                           "(it is in the 'test' extra: pip install -e '.[test]')")

from baton.model import triton_kernels as tk  # noqa: E402
from baton.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan, PagedAttention  # noqa: E402
from baton.model.triton_attention import (  # noqa: E402
    TritonAttention, attention_backend, to_triton, triton_available)

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # block 0 reserved; 23 usable blocks of 4 = 92 slots


def _cache(kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    # random everywhere, so a kernel reading a wrong slot (or the reserved block 0) shows
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim, generator=g).to(dtype).to(DEVICE)


def _tables(context_lens: list[int], seed: int = 1) -> tuple[list[list[int]], torch.Tensor]:
    """Distinct, shuffled non-zero blocks for each request (so neighbouring positions live in
    non-neighbouring blocks), and the padded table tensor (padding -> block 0)."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()
    tables = []
    for n in context_lens:
        need = -(-n // BLOCK_SIZE)
        tables.append(free[:need])
        free = free[need:]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    return tables, padded


def _slots(table: list[int], n: int) -> torch.Tensor:
    return torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)], device=DEVICE)


def _reference(q: torch.Tensor, cache: torch.Tensor, table: list[int], context_len: int, scale: float,
               softcap: float | None, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, heads, d], the queries at positions context_len - n .. context_len - 1 of one request
    -> [n, heads, d] in fp32, by the definition of attention (sinks: one more logit per head in
    every softmax row, whose weight is then dropped)."""
    n, heads, _ = q.shape
    kv_heads = cache.shape[1]
    slots = _slots(table, context_len)
    k = cache[0][:, slots].float()  # [kv_heads, ctx, d]
    v = cache[1][:, slots].float()
    head_of_kv = torch.arange(heads, device=q.device) // (heads // kv_heads)
    k, v = k[head_of_kv], v[head_of_kv]  # [heads, ctx, d]: query head h reads KV head h // group
    scores = torch.einsum("nhd,hcd->hnc", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos_q = torch.arange(context_len - n, context_len, device=q.device).unsqueeze(1)  # [n, 1]
    pos_k = torch.arange(context_len, device=q.device).unsqueeze(0)  # [1, ctx]
    attend = pos_k <= pos_q
    if window is not None:
        attend &= pos_k > pos_q - window
    scores = scores.masked_fill(~attend, float("-inf"))
    if sinks is not None:
        sink_column = sinks.float().view(heads, 1, 1).expand(heads, n, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnc,hcd->nhd", probs, v)


def test_write_kv_puts_each_row_in_its_slot_and_skips_padding() -> None:
    kv_heads, d = 2, 64
    cache = _cache(kv_heads, d)
    before = cache.clone()
    k = torch.randn(5, kv_heads, d, device=DEVICE)
    v = torch.randn(5, kv_heads, d, device=DEVICE)
    slots = torch.tensor([9, 40, 41, -1, 3], device=DEVICE)  # -1: a padded row, written nowhere
    tk.write_kv(cache, k, v, slots)
    expected = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[0, :, s] = k[t]
            expected[1, :, s] = v[t]
    assert torch.equal(cache, expected)


def test_write_kv_matches_the_torch_backend() -> None:
    cache_t, cache_tr = _cache(2, 64), _cache(2, 64)
    k, v = torch.randn(3, 2, 64, device=DEVICE), torch.randn(3, 2, 64, device=DEVICE)
    meta = AttentionMetadata(torch.tensor([17, 4, 60], device=DEVICE), [], [], BLOCK_SIZE)
    PagedAttention(4, 2, 64).write_kv(cache_t, k, v, meta)
    TritonAttention(4, 2, 64).write_kv(cache_tr, k, v, meta)
    assert torch.equal(cache_t, cache_tr)


DECODE_CASES = [
    # heads, kv_heads, head_dim, softcap, window, num_splits
    (4, 4, 64, None, None, 1),  # MHA, one range
    (4, 2, 64, None, None, 3),  # GQA 2, the context split in 3 and reduced
    (8, 2, 128, None, None, 2),  # GQA 4, head_dim 128
    (2, 1, 256, None, None, 2),  # head_dim 256
    (4, 2, 64, 5.0, None, 2),  # soft-capped logits (Gemma 2: scores small enough that the cap bites)
    (4, 2, 64, None, 6, 2),  # sliding window shorter than most contexts
    (4, 2, 80, 5.0, 9, 3),  # head_dim not a power of two, window and cap together
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,softcap,window,splits", DECODE_CASES)
def test_paged_decode_equals_attention_over_the_gathered_context(heads: int, kv_heads: int, head_dim: int,
                                                                 softcap: float | None, window: int | None,
                                                                 splits: int) -> None:
    context_lens = [1, 7, 37, 16]  # one key only; part of a block; many blocks; exactly whole blocks
    cache = _cache(kv_heads, head_dim)
    tables, padded = _tables(context_lens)
    q = torch.randn(len(context_lens), heads, head_dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    scale = 0.7 if softcap else head_dim**-0.5
    out = tk.paged_decode(q, cache, padded, torch.tensor(context_lens, device=DEVICE), BLOCK_SIZE, scale,
                          max_context=padded.shape[1] * BLOCK_SIZE, softcap=softcap, window=window,
                          num_splits=splits)
    for i, n in enumerate(context_lens):
        ref = _reference(q[i:i + 1], cache, tables[i], n, scale, softcap, window)[0]
        torch.testing.assert_close(out[i], ref, rtol=1e-4, atol=1e-5)


def test_paged_decode_split_count_does_not_change_the_result() -> None:
    cache = _cache(2, 64)
    tables, padded = _tables([45, 3])
    q = torch.randn(2, 4, 64, device=DEVICE)
    lens = torch.tensor([45, 3], device=DEVICE)
    outs = [tk.paged_decode(q, cache, padded, lens, BLOCK_SIZE, 0.125, max_context=48, num_splits=s)
            for s in (1, 2, 4)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-5, atol=1e-6)


def test_decode_splits_fill_the_gpu_only_for_long_contexts() -> None:
    assert tk.decode_splits(200, batch=1, kv_heads=8) == 1  # short: one range
    assert tk.decode_splits(700, batch=1, kv_heads=8) == 2  # no range under 256 keys
    assert tk.decode_splits(8192, batch=1, kv_heads=8) == 32  # long and alone: split (capped)
    assert tk.decode_splits(8192, batch=64, kv_heads=8) == 1  # the batch fills the GPU already


PREFILL_CASES = [
    # heads, kv_heads, head_dim, softcap, window
    (4, 2, 64, None, None),
    (2, 2, 128, None, None),
    (4, 1, 64, 5.0, None),
    (4, 2, 64, None, 5),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,softcap,window", PREFILL_CASES)
def test_paged_prefill_varlen_causal_over_prefix_and_chunk(heads: int, kv_heads: int, head_dim: int,
                                                           softcap: float | None, window: int | None) -> None:
    # (cached prefix, chunk length): a first chunk; a chunk after a partial block; a chunk of more
    # queries than one program's tile (16) after a long prefix
    chunks = [(0, 5), (7, 3), (21, 19)]
    context_lens = [p + n for p, n in chunks]
    cache = _cache(kv_heads, head_dim)
    tables, padded = _tables(context_lens)
    total = sum(n for _, n in chunks)
    q = torch.randn(total, heads, head_dim, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    starts = torch.tensor([0, 5, 8], dtype=torch.int32, device=DEVICE)
    scale = 0.7 if softcap else head_dim**-0.5
    out = tk.paged_prefill(q, cache, padded, starts, torch.tensor([n for _, n in chunks], device=DEVICE),
                           torch.tensor(context_lens, device=DEVICE), BLOCK_SIZE, scale, max_q_len=19,
                           softcap=softcap, window=window)
    for i, (prefix, n) in enumerate(chunks):
        s = int(starts[i])
        ref = _reference(q[s:s + n], cache, tables[i], prefix + n, scale, softcap, window)
        torch.testing.assert_close(out[s:s + n], ref, rtol=1e-4, atol=1e-5)


def test_bf16_kernels_stay_within_bf16_rounding_of_the_fp32_reference() -> None:
    cache = _cache(2, 64, torch.bfloat16)
    tables, padded = _tables([30, 9])
    q = torch.randn(2, 4, 64, device=DEVICE).to(torch.bfloat16)
    out = tk.paged_decode(q, cache, padded, torch.tensor([30, 9], device=DEVICE), BLOCK_SIZE, 0.125,
                          max_context=32, num_splits=2)
    assert out.dtype == torch.bfloat16
    for i, n in enumerate([30, 9]):
        ref = _reference(q[i:i + 1], cache, tables[i], n, 0.125, None, None)[0]
        torch.testing.assert_close(out[i].float(), ref, rtol=2e-2, atol=2e-2)
    qp = torch.randn(12, 4, 64, device=DEVICE).to(torch.bfloat16)  # one chunk: prefix 18, 12 new
    outp = tk.paged_prefill(qp, cache, padded[:1], torch.tensor([0], device=DEVICE), torch.tensor([12], device=DEVICE),
                            torch.tensor([30], device=DEVICE), BLOCK_SIZE, 0.125, max_q_len=12)
    ref = _reference(qp, cache, tables[0], 30, 0.125, None, None)
    torch.testing.assert_close(outp.float(), ref, rtol=2e-2, atol=2e-2)


def test_triton_backend_equals_the_torch_backend_on_runner_metadata() -> None:
    """The backend methods the model calls, on metadata shaped as the model runner builds it (long
    block ids padded with block 0, masks for the padded path), give what PagedAttention gives."""
    heads, kv_heads, d = 4, 2, 64
    cache = _cache(kv_heads, d)
    lens = [10, 3]
    tables, _ = _tables(lens + [13])
    width = 3
    ids = torch.tensor([b for t in tables[:2] for b in t + [0] * (width - len(t))], device=DEVICE)
    length = width * BLOCK_SIZE
    mask = torch.arange(length).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    group = DecodeGroup(0, 2, width, ids, torch.tensor(lens, device=DEVICE), bias.view(1, 2, 1, -1).to(DEVICE),
                        mask.view(2, 1, 1, -1).to(DEVICE))
    q = torch.randn(2, heads, d, device=DEVICE)
    torch_out = PagedAttention(heads, kv_heads, d).decode(q, cache, group, BLOCK_SIZE)
    triton_out = TritonAttention(heads, kv_heads, d).decode(q, cache, group, BLOCK_SIZE)
    torch.testing.assert_close(triton_out, torch_out, rtol=1e-4, atol=1e-5)
    # a second chunk of 6 after a prefix of 7 (the chunk's K/V already in the cache, as the model writes it)
    slots = _slots(tables[2], 13)
    span_mask = (torch.arange(13).unsqueeze(0) <= torch.arange(7, 13).unsqueeze(1)).view(1, 1, 6, 13).to(DEVICE)
    span = PrefillSpan(0, 6, 13, slots, span_mask, block_ids=torch.tensor(tables[2], device=DEVICE),
                       block_size=BLOCK_SIZE)
    qp = torch.randn(6, heads, d, device=DEVICE)
    k_new, v_new = cache[0][:, slots[7:]].transpose(0, 1), cache[1][:, slots[7:]].transpose(0, 1)
    torch_p = PagedAttention(heads, kv_heads, d).prefill(qp, k_new, v_new, cache, span)
    triton_p = TritonAttention(heads, kv_heads, d).prefill(qp, k_new, v_new, cache, span)
    torch.testing.assert_close(triton_p, torch_p, rtol=1e-4, atol=1e-5)


def test_cpu_devices_keep_the_torch_backend() -> None:
    assert not triton_available("cpu", requested=True)
    backend = attention_backend("cpu", 4, 2, 64, softcap=30.0, window=8, triton=True)
    assert type(backend) is PagedAttention and backend.softcap == 30.0


def test_a_converted_window_layer_attends_only_its_window() -> None:
    """`to_triton` keeps the layer's scale and cap and takes its window: the decode output is the
    window's attention, not the whole context's."""
    cache = _cache(2, 64)
    tables, padded = _tables([20])
    layer = to_triton(PagedAttention(4, 2, 64, scale=0.3, softcap=4.0), window=6)
    assert (layer.scale, layer.softcap, layer.window) == (0.3, 4.0, 6)
    ids = padded.view(-1).long()
    group = DecodeGroup(0, 1, padded.shape[1], ids, torch.tensor([20], device=DEVICE), None, None)
    q = torch.randn(1, 4, 64, device=DEVICE)
    out = layer.decode(q, cache, group, BLOCK_SIZE)
    torch.testing.assert_close(out[0], _reference(q, cache, tables[0], 20, 0.3, 4.0, 6)[0], rtol=1e-4, atol=1e-5)
    whole = _reference(q, cache, tables[0], 20, 0.3, 4.0, None)[0]
    assert not torch.allclose(out[0], whole, rtol=1e-3, atol=1e-3)


def test_attention_sinks_take_their_share_of_every_row() -> None:
    """gpt-oss's sink logits (one per head, in each softmax row's denominator only), through a split
    decode and a multi-tile prefill chunk."""
    heads, kv_heads, d = 4, 2, 64
    cache = _cache(kv_heads, d)
    tables, padded = _tables([37, 22])
    sinks = torch.tensor([0.5, 3.0, -2.0, 8.0], device=DEVICE)  # 8.0: the sink dominates that head
    q = torch.randn(2, heads, d, device=DEVICE)
    out = tk.paged_decode(q, cache, padded, torch.tensor([37, 22], device=DEVICE), BLOCK_SIZE, 0.125,
                          max_context=padded.shape[1] * BLOCK_SIZE, num_splits=3, sinks=sinks)
    for i, n in enumerate([37, 22]):
        ref = _reference(q[i:i + 1], cache, tables[i], n, 0.125, None, None, sinks)[0]
        torch.testing.assert_close(out[i], ref, rtol=1e-4, atol=1e-5)
    assert out[:, 3].abs().max() < 0.5 * out[:, 0].abs().max()  # the sink took most of head 3's weight
    qp = torch.randn(18, heads, d, device=DEVICE)  # prefix 4, 18 new: two query tiles
    outp = tk.paged_prefill(qp, cache, padded[1:], torch.tensor([0], device=DEVICE), torch.tensor([18], device=DEVICE),
                            torch.tensor([22], device=DEVICE), BLOCK_SIZE, 0.125, max_q_len=18, sinks=sinks)
    ref = _reference(qp, cache, tables[1], 22, 0.125, None, None, sinks)
    torch.testing.assert_close(outp, ref, rtol=1e-4, atol=1e-5)
