"""A GGUF MoE's experts served as the file's own blocks, one `QuantizedLinear` per expert and kind.

A MoE's experts are most of its bytes (Qwen3.5-35B-A3B: ~95%), and a GGUF ships them as 3-D tensors of
blocks (`blk.N.ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: [experts, rows, blocks along the
input]). They were dequantized at load into the model's dtype, 2-4x the file's bytes in bf16 and
4-8x in float32 (what a CPU without bf16 instructions loads): a 20 GB Q4_K_M MoE that llama.cpp
serves from its mapped file would need 80-160 GB. Now, as for the projections
(baton.model.gguf_weights), the loader leaves each MoE's expert stacks unread (`gguf_expert_targets`)
and each expert's slice of the file's blocks becomes the native kernel's op without requantizing:
Q8_0 as int8 blocks, Q4_0 / Q4_1 / Q4_K as 4-bit ones (gate and up joined, gate rows first, as the
dense stack has them), any other type (Q4_K_M's Q6_K down experts, Q5_K, ...) dequantized and
requantized to Q8_0 one expert at a time. Each layer's ops are checked on sampled experts and rows
against the dense stack the loader would have made (read then, one layer at a time), so a mapping
mistake is an error at load. The experts' packs then join the machine's shared weights file
(baton.model.shared_weights): one copy per machine.

Served where the rows need no reordering (the experts of every GGUF architecture transformers reads:
none permutes them) and the routing is a plain SparseMoE's (gpt-oss's interleaved gate/up and
biases stay dense).
"""

from __future__ import annotations

import collections
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from baton.model.gguf_checkpoint import drop_touched_pages
from baton.model.linear import QuantizedLinear
from baton.model.loader import UnreadWeights
from baton.model.moe import SparseMoE
from baton.model.q_blocks import quantize_q8_0

logger = logging.getLogger("baton.model.gguf_experts")

# Baton's expert stack -> the GGUF tensors it is made of, joined along the rows in this order
EXPERT_TENSORS = {"experts_gate_up": ("ffn_gate_exps", "ffn_up_exps"), "experts_down": ("ffn_down_exps",)}
CHECKED_EXPERTS = 3  # per stack: the first, the last and one between (every expert's rows are alike)


def _moes(model: nn.Module) -> list[tuple[str, int, SparseMoE]]:
    """(module name, block index, module) of each MoE the experts of the file can serve."""
    out = []
    for name, module in model.named_modules():
        match = re.fullmatch(r"layers\.(\d+)\.[a-z_]+", name)
        if isinstance(module, SparseMoE) and match and not module.clamped_swiglu and module.expert_ops is None:
            out.append((name, int(match.group(1)), module))
    return out


def _tensors(source: Any, block: int, kind: str) -> list[Any] | None:
    """The GGUF tensors of one expert stack, or None where they cannot be served as blocks (missing,
    dense, or converted by more than a join of gate and up)."""
    from baton.model.gguf_weights import DENSE_TYPES

    tensors = [source.tensors.get(f"blk.{block}.{leaf}.weight") for leaf in EXPERT_TENSORS[kind]]
    if any(t is None or t.data.ndim != 3 or source.type_name(t) in DENSE_TYPES for t in tensors):
        return None
    mapped = getattr(source, "_mapped", None)
    if mapped is not None and any(not _joins_only(mapped, t.name) for t in tensors):
        return None
    return tensors


def _joins_only(mapped: Any, gguf_name: str) -> bool:
    """Whether transformers' conversion of this tensor only renames it or joins it with its siblings."""
    from transformers.core_model_loading import Concatenate

    converter = mapped._converter_of.get(gguf_name)
    return converter is None or all(isinstance(op, Concatenate) and getattr(op, "dim", None) == 1
                                    for op in converter.operations)


def gguf_expert_targets(model: nn.Module, source: Any) -> set[str]:
    """The expert stacks (parameter names) the GGUF's blocks will serve: the loader leaves them unread."""
    targets = set()
    for name, block, _ in _moes(model):
        kinds = [kind for kind in EXPERT_TENSORS if _tensors(source, block, kind) is not None]
        if len(kinds) == len(EXPERT_TENSORS):  # both stacks, or neither (use_quantized_experts takes both)
            targets |= {f"{name}.{kind}" for kind in kinds}
    return targets


def _expert_parts(source: Any, tensors: list[Any], expert: int) -> tuple[str, tuple[torch.Tensor, ...], str]:
    """One expert's weight [rows, in] from its slices of `tensors`: (scheme, parts, label)."""
    from gguf import dequantize

    from baton.model.gguf_weights import FOUR_BIT_TYPES, unpack_q4, unpack_q8_0

    types = [source.type_name(t) for t in tensors]
    shapes = [(int(t.shape[1]), int(t.shape[0])) for t in tensors]  # ggml: [in, rows, experts]
    raws = [np.asarray(t.data[expert]) for t in tensors]  # [rows, bytes per row] each
    label = "+".join(sorted(set(types)))
    if all(t == "Q8_0" for t in types):
        unpacked = [unpack_q8_0(raw, n, k) for raw, (n, k) in zip(raws, shapes)]
        return "q8_0", tuple(torch.cat(ps) for ps in zip(*unpacked)), label
    if all(t in FOUR_BIT_TYPES for t in types):
        unpacked4 = [unpack_q4(raw, kind, n, k) for raw, kind, (n, k) in zip(raws, types, shapes)]
        return "q4", tuple(torch.cat(ps) for ps in zip(*unpacked4)), label
    weight = torch.cat([torch.from_numpy(np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32)).reshape(n, k)
                        for raw, t, (n, k) in zip(raws, tensors, shapes)])
    return "q8_0", quantize_q8_0(weight), label + " requantized to Q8_0"


def load_gguf_experts(model: nn.Module, gguf_path: Path, kernels: Any, unread: UnreadWeights | None) -> dict[str, int]:
    """Serve each MoE's experts that `gguf_expert_targets` left unread from the GGUF's blocks (see the
    module docstring). Returns how many expert stacks took each form."""
    from baton.model.gguf_weights import GGUFTensors, _check

    config = model.config
    source = GGUFTensors(gguf_path, config.num_heads, config.num_kv_heads)
    targets = gguf_expert_targets(model, source)
    counts: collections.Counter[str] = collections.Counter()
    for name, block, moe in _moes(model):
        if f"{name}.experts_gate_up" not in targets:
            continue
        ops: dict[str, list[QuantizedLinear]] = {}
        for kind in EXPERT_TENSORS:
            tensors = _tensors(source, block, kind)
            assert tensors is not None
            param = getattr(moe, kind)
            loaded = unread.read(f"{name}.{kind}") if param.is_meta and unread is not None else param
            if any(len(t.data) != moe.num_experts for t in tensors):
                raise ValueError(f"the GGUF's {tensors[0].name} has {len(tensors[0].data)} experts, the model "
                                 f"{moe.num_experts}")
            checked = set(np.linspace(0, moe.num_experts - 1, CHECKED_EXPERTS).round().astype(int).tolist())
            ops[kind] = []
            for expert in range(moe.num_experts):
                scheme, parts, label = _expert_parts(source, tensors, expert)
                if tuple(parts[0].shape) != tuple(loaded.shape[1:]):
                    raise ValueError(f"the GGUF's {'+'.join(t.name for t in tensors)} expert {expert} is "
                                     f"{tuple(parts[0].shape)}, the model's {tuple(loaded.shape[1:])}")
                if expert in checked:
                    _check(parts, scheme, loaded[expert], f"{'+'.join(t.name for t in tensors)} expert {expert}")
                ops[kind].append(QuantizedLinear(scheme, parts, None, kernels))
            counts[label] += 1
            del loaded
            drop_touched_pages(source.reader)
        moe.use_quantized_experts(ops["experts_gate_up"], ops["experts_down"])
    if counts:
        logger.info("GGUF %s: MoE experts served in the file's own blocks: %s", gguf_path.name,
                    ", ".join(f"{n} {t} stacks" for t, n in sorted(counts.items())))
    return dict(counts)
