"""All decoder layers of a decode-only step as one native call (`kernels/decode_layers.cpp`).

At batch 1 a step is ~8 native calls per layer once the matmuls stream at the machine's bandwidth;
the Python around them (interpreter, argument parsing, tensor wrapping) was ~15% of the step. The
plan holds what the C++ loop needs (the norms in order, each projection's pack: the native bf16
few-row pack and the oneDNN pack, or the quantized blocks' pack; the row counts up to which each
projection takes the native kernel) and makes the same calls in the same order as the Python loop of
the native path (`CausalLM._forward_fused`), so the output is bit-identical (tests/test_kernels.py).

`LayersPlan.build` makes one only for the plain Llama layer with the native kernels (`prepare`, and
`quantize_model` again over the quantized packs): every projection bias-free and packed (bf16, or
quantized with the native integer kernel), dense MLPs, and oneDNN callable from C++ on this torch;
else it returns None and the Python loop runs. `run` also carries the step's thread gate
(baton/model/thread_gate.py): lent threads the C++ loop gives back between layers when asked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from baton.model.attention import AttentionMetadata
from baton.model.linear import ALL_ROWS, PackedLinear, QuantizedLinear, RowSplitLinear
from baton.model.thread_gate import ThreadGate, no_gate_args

logger = logging.getLogger("baton.model.layers_plan")


@dataclass
class LayersPlan:
    """Every decoder layer of a decode-only step as one native call (`kernels/decode_layers.cpp`): the
    calls `_forward_fused` makes per layer, made from C++ (at batch 1 the Python around ~240 native
    calls per step was ~15% of it). Built where every projection is a bias-free packed matmul
    (`PackedLinear`, `RowSplitLinear` with its native few-row kernel, or a `QuantizedLinear` the
    native integer kernel runs); otherwise, and for steps with prefill chunks, the Python loop runs."""

    kernel: Any
    norms: list[torch.Tensor]  # 2L + 1 RMSNorm weights, in the order they apply
    eps: float
    weights: list[torch.Tensor]  # per layer and projection (qkv, o, gate_up, down): native pack, oneDNN pack
    out_features: list[int]  # per projection kind
    max_native_rows: list[int]  # per projection kind: the native kernel up to this many rows
    num_heads: int
    scale: float

    @staticmethod
    def build(model: torch.nn.Module, kernel: Any) -> LayersPlan | None:
        # model: a baton.model.model.CausalLM (not imported: that module imports this one)
        if kernel is None or not hasattr(kernel, "decode_layers") or not model.layers:
            return None
        if not all(hasattr(layer.mlp, "gate_up") for layer in model.layers):
            return None  # MoE layers: their experts run in baton.model.moe
        ops = [[layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down] for layer in model.layers]
        kinds = (PackedLinear, RowSplitLinear, QuantizedLinear)
        if not all(isinstance(op, kinds) and op.bias is None for row in ops for op in row):
            return None
        if any(isinstance(op, QuantizedLinear) and not op.native for row in ops for op in row):
            return None
        dense = [op for row in ops for op in row if _onednn_pack(op) is not None]
        if dense and not LayersPlan._onednn_from_cpp_agrees(_onednn(dense[0]), kernel):
            return None
        empty = torch.empty(0, dtype=torch.bfloat16)  # no native pack: that projection is oneDNN only
        weights: list[torch.Tensor] = []
        for row in ops:
            for op in row:
                if isinstance(op, QuantizedLinear):  # quantized: qgemv for every row count (its uint8 pack says so)
                    weights += [op.packed, empty]
                else:
                    onednn = _onednn_pack(op)
                    weights += [op.packed if isinstance(op, RowSplitLinear) else empty,
                                onednn if onednn is not None else empty]
        max_native_rows = [min(_max_native_rows(row[j]) for row in ops) for j in range(4)]
        norms = [model.layers[0].input_layernorm.weight]
        for i, layer in enumerate(model.layers):
            following = model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else model.norm
            norms += [layer.post_attention_layernorm.weight, following.weight]
        attn = model.layers[0].self_attn
        return LayersPlan(kernel, [w.detach() for w in norms], model.norm.eps, weights,
                          [op.out_features for op in ops[0]], max_native_rows, attn.num_heads, attn.scale)

    @staticmethod
    def _onednn_from_cpp_agrees(large: PackedLinear, kernel: Any) -> bool:
        """The plan calls oneDNN's matmul through the dispatcher by its schema; where this torch's
        schema differs, it must not be used (then the Python loop runs)."""
        probe = torch.randn(5, large.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        try:
            with torch.inference_mode():
                return bool(torch.equal(kernel.onednn_linear(probe, large.packed), large(probe)))
        except RuntimeError as exc:
            logger.warning("oneDNN matmul from C++ unavailable (%s): decode layers run from Python", exc)
            return False

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
            meta: AttentionMetadata, gate: ThreadGate | None = None) -> torch.Tensor:
        # x: [B, H] embeddings (the residual stream, updated in place); cos, sin: [B, 1, d];
        # kv_cache: [L, 2, kv_heads, slots, d] -> [B, H], the final norm's output.
        # gate: lent threads, given back between layers when their owner asks (thread_gate.py)
        group = meta.decode_groups[0]
        if gate is not None:
            gate.enter()
        try:
            return self.kernel.decode_layers(x, self.norms, self.eps, self.weights, self.out_features,
                                             self.max_native_rows, kv_cache, cos, sin, meta.slot_mapping,
                                             group.block_ids.view(group.count, -1), group.context_lens,
                                             self.num_heads, meta.block_size, self.scale,
                                             *(gate.native_args() if gate is not None else no_gate_args()))
        finally:
            if gate is not None:
                gate.leave()


def _max_native_rows(op: Any) -> int:
    if isinstance(op, RowSplitLinear):
        return op.max_native_rows
    return ALL_ROWS if not isinstance(op, PackedLinear) else 0  # int8 runs its kernel for every row count


def _onednn_pack(op: Any) -> torch.Tensor | None:
    """The oneDNN pack the C++ loop may call for this op (None: never, its native kernel takes every
    row count, and the pack may be released)."""
    if isinstance(op, QuantizedLinear) or (isinstance(op, RowSplitLinear) and op.max_native_rows >= ALL_ROWS):
        return None
    return _onednn(op).packed


def _onednn(op: PackedLinear | RowSplitLinear) -> PackedLinear:
    return op.large if isinstance(op, RowSplitLinear) else op
