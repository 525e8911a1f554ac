"""The attention backend for CUDA devices: `PagedAttention`'s interface over the Triton kernels of
`baton.model.triton_kernels` (issue 43), so that a step reads the paged pool in place instead of
gathering every request's KV into a contiguous copy per layer.

`triton_available(device, requested)` is the one switch: True only for a CUDA device with triton
importable, when the runtime's config asks for it (`RuntimeConfig.triton`, default `BATON_TRITON`). The CPU path never takes this backend: a CPU device keeps
`PagedAttention` and its native kernels exactly as before. What the kernels do not cover (a
quantized int8/fp8 cache) falls back to the torch path method by method.

Status: the kernels are checked against a first-principles torch reference and against
`PagedAttention` on the CPU under Triton's interpreter (tests/test_triton_kernels.py); they have not
yet run on a GPU (timings and the CUDA parity run are scripts/gpu_check.sh's job).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from baton.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan, PagedAttention


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available(device: torch.device | str, requested: bool) -> bool:
    """Whether attention on `device` should run the Triton kernels: `requested` (RuntimeConfig.triton,
    BATON_TRITON=1) and CUDA with triton installed (it ships with CUDA builds of torch). Opt-in until
    the compiled kernels have passed scripts/gpu_check.sh on a GPU (they are verified under the
    interpreter only: issue 43). Never for a CPU device: the interpreter is for tests, and the CPU
    path is unchanged."""
    device = torch.device(device)
    if device.type != "cuda" or not requested:
        return False
    return triton_importable() and torch.cuda.is_available()


def _kernels() -> Any:
    # imported on first use: importing triton costs time and is absent on CPU-only installs
    from baton.model import triton_kernels
    return triton_kernels


class TritonAttention(PagedAttention):
    """Paged attention through the Triton kernels. `window` is the layer's sliding window (None for
    a global layer): the kernels take the window itself instead of the windowed masks.

    It keeps `pads_decode` True (the runner still builds its padded-path masks, which
    `attention.windowed` requires); the kernels ignore the masks and read each request's own blocks
    only, so a runner change to one decode group (no grouping by length) is a later step."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 softcap: float | None = None, window: int | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, softcap)
        self.window = window

    def _sinks(self) -> torch.Tensor | None:
        # gpt-oss's per-head sink logits ([heads]), where PagedAttention has them
        return getattr(self, "sinks", None)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        if self.kv_dtype is not None:  # quantized rows: the torch path
            super().write_kv(kv_cache, k, v, meta)
            return
        _kernels().write_kv(kv_cache, k, v, meta.slot_mapping)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, block_size: int) -> torch.Tensor:
        if self.kv_dtype is not None:
            return super().decode(q, kv_cache, group, block_size)
        tables = group.block_ids.view(group.count, group.num_blocks)
        return _kernels().paged_decode(q, kv_cache, tables, group.context_lens, block_size, self.scale,
                                       max_context=group.num_blocks * block_size, softcap=self.softcap,
                                       window=self.window, sinks=self._sinks())

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                span: PrefillSpan) -> torch.Tensor:
        if self.kv_dtype is not None or span.block_ids is None:
            return super().prefill(q, k, v, kv_cache, span)
        return self.prefill_batch(q, kv_cache, [span], first=span.start)

    def prefill_batch(self, q: torch.Tensor, kv_cache: torch.Tensor, spans: list[PrefillSpan],
                      first: int = 0) -> torch.Tensor:
        """All of a step's prefill chunks in one varlen launch. q: the rows of the chunks, row 0 being
        flattened-step row `first` (the spans' starts are step rows) -> [rows, heads, d]."""
        device = q.device
        width = max(len(s.block_ids) for s in spans if s.block_ids is not None)
        tables = torch.zeros(len(spans), width, dtype=torch.int32, device=device)
        for i, s in enumerate(spans):
            tables[i, :len(s.block_ids)] = s.block_ids.to(device=device, dtype=torch.int32)
        starts = torch.tensor([s.start - first for s in spans], dtype=torch.int32, device=device)
        lens = torch.tensor([s.length for s in spans], dtype=torch.int32, device=device)
        ctx = torch.tensor([s.context_len for s in spans], dtype=torch.int32, device=device)
        return _kernels().paged_prefill(q, kv_cache, tables, starts, lens, ctx, spans[0].block_size, self.scale,
                                        max_q_len=max(s.length for s in spans), softcap=self.softcap,
                                        window=self.window, sinks=self._sinks())


def to_triton(backend: PagedAttention, window: int | None) -> TritonAttention:
    """`backend` as a TritonAttention with the same heads, scale, soft-cap and KV dtype, for a layer
    with sliding window `window` (None: global). The wiring point: `CausalLM.prepare`, where the
    parameters' device is known, would do for a CUDA model with `triton_available(device, requested)`:
        layer.self_attn.backend = to_triton(layer.self_attn.backend,
                                            config.sliding_window if layer.self_attn.sliding else None)"""
    converted = TritonAttention(backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale,
                                backend.softcap, window)
    converted.kv_dtype = backend.kv_dtype
    if getattr(backend, "sinks", None) is not None:
        converted.sinks = backend.sinks  # type: ignore[attr-defined]
    return converted


def attention_backend(device: torch.device | str, num_heads: int, num_kv_heads: int, head_dim: int,
                      scale: float | None = None, softcap: float | None = None,
                      window: int | None = None, triton: bool = False) -> PagedAttention:
    """The backend a layer on `device` runs: Triton on CUDA when `triton` asks and it is available,
    else the torch path (CPU: always, unchanged). The wiring point for `baton.model.model.Attention`."""
    if triton_available(device, triton):
        return TritonAttention(num_heads, num_kv_heads, head_dim, scale, softcap, window)
    return PagedAttention(num_heads, num_kv_heads, head_dim, scale, softcap)
