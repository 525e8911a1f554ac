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
against those experts as the loader would have made them (each read alone, `UnreadWeights.read_expert`:
never a layer's whole dense stack), so a mapping mistake is an error at load. With the native
kernels the first worker streams the packs into a file of the machine's packed cache, a stack at a
time, and every worker maps it read-only: one copy per machine, and a worker that finds the file
repacks and reads nothing (baton.model.packed_cache).

Served where the rows need no reordering (the experts of every GGUF architecture transformers reads:
none permutes them) and the routing is a plain SparseMoE's (gpt-oss's interleaved gate/up and
biases stay dense).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from baton.model.gguf_checkpoint import drop_touched_pages
from baton.model.gguf_embeddings import gguf_embedding_targets
from baton.model.gguf_weights import (DENSE_TYPES, GGUFTensors, _check, gguf_projection_targets, served_parts,
                                      shared_packs_file)
from baton.model.linear import QuantizedLinear
from baton.model.loader import UnreadWeights
from baton.model.moe import SparseMoE
from baton.model.packed_cache import PackedSlot, SharedPacks

logger = logging.getLogger("baton.model.gguf_experts")

# Baton's expert stack -> the GGUF tensors it may be made of (joined along the rows in this order): gate
# and up apart, or (Gemma 4's converter) already joined, gate rows first, as the checkpoint's gate_up_proj
EXPERT_TENSORS = {"experts_gate_up": (("ffn_gate_exps", "ffn_up_exps"), ("ffn_gate_up_exps",)),
                  "experts_down": (("ffn_down_exps",),)}
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
    tensors = next((found for leaves in EXPERT_TENSORS[kind]
                    if None not in (found := [source.tensors.get(f"blk.{block}.{leaf}.weight") for leaf in leaves])),
                   None)
    if tensors is None or any(t.data.ndim != 3 or source.type_name(t) in DENSE_TYPES for t in tensors):
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


def gguf_block_targets(model: nn.Module, gguf_path: Path) -> set[str]:
    """Every parameter the GGUF's blocks will serve, which the loader leaves unread: the projections'
    (baton.model.gguf_weights), the MoE expert stacks' and the token tables' (baton.model.gguf_embeddings)."""
    source = GGUFTensors.of(model, gguf_path)
    return (gguf_projection_targets(model, source) | gguf_expert_targets(model, source)
            | gguf_embedding_targets(model, source))


def _expert_parts(source: Any, tensors: list[Any], expert: int) -> tuple[str, tuple[torch.Tensor, ...], str]:
    """One expert's weight [rows, in] from its slices of `tensors`: (scheme, parts, label)."""
    from gguf import dequantize

    types = [source.type_name(t) for t in tensors]
    shapes = [(int(t.shape[1]), int(t.shape[0])) for t in tensors]  # ggml: [in, rows, experts]
    raws = [np.asarray(t.data[expert]) for t in tensors]  # [rows, bytes per row] each

    def dense(i: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(dequantize(raws[i], tensors[i].tensor_type), dtype=np.float32)
                                ).reshape(shapes[i])

    scheme, parts, requantized = served_parts(types, shapes, raws.__getitem__, dense)
    return scheme, parts, "+".join(sorted(set(types))) + (" requantized to Q8_0" if requantized else "")


Stack = tuple[str, SparseMoE, str, list[Any]]  # (module name, its MoE, expert kind, the GGUF tensors)


def _stacks(model: nn.Module, source: Any) -> list[Stack]:
    """The expert stacks the file's blocks serve, in the model's order (both kinds of each MoE)."""
    targets = gguf_expert_targets(model, source)
    out = []
    for name, block, moe in _moes(model):
        if f"{name}.experts_gate_up" in targets:
            for kind in EXPERT_TENSORS:
                tensors = _tensors(source, block, kind)
                assert tensors is not None
                out.append((name, moe, kind, tensors))
    return out


def _packs(source: Any, stacks: list[Stack], kernels: Any,
           unread: UnreadWeights | None) -> Iterator[tuple[PackedSlot, QuantizedLinear]]:
    """Each expert's op of each stack, in order, the stack checked on sampled experts against the
    weight the loader would have made (read once per stack, then dropped)."""
    for name, moe, kind, tensors in stacks:
        where = "+".join(t.name for t in tensors)
        if any(len(t.data) != moe.num_experts for t in tensors):
            raise ValueError(f"the GGUF's {where} holds {len(tensors[0].data)} experts, the model {moe.num_experts}")
        param = getattr(moe, kind)
        checked = set(np.linspace(0, moe.num_experts - 1, CHECKED_EXPERTS).round().astype(int).tolist())
        for expert in range(moe.num_experts):
            scheme, parts, label = _expert_parts(source, tensors, expert)
            if tuple(parts[0].shape) != tuple(param.shape[1:]):
                raise ValueError(f"the GGUF's {where} expert {expert} is {tuple(parts[0].shape)}, the model's "
                                 f"{tuple(param.shape[1:])}")
            if expert in checked:
                # the expert as the loader would have made it, read alone (never the layer's whole stack)
                loaded = (unread.read_expert(f"{name}.{kind}", expert) if param.is_meta and unread is not None
                          else param[expert])
                _check(parts, scheme, loaded, f"{where} expert {expert}")
            op = QuantizedLinear(scheme, parts, None, kernels)
            yield PackedSlot(label, scheme, op.out_features, op.in_features, op.packed), op
        drop_touched_pages(source.reader)


def _shared_packs(gguf_path: Path, stacks: list[Stack], kernels: Any) -> SharedPacks | None:
    layout = {"experts": [[name, kind, [t.name for t in tensors]] for name, _, kind, tensors in stacks]}
    return shared_packs_file(gguf_path, layout, kernels, "expert packs")


def load_gguf_experts(model: nn.Module, source: GGUFTensors, kernels: Any,
                      unread: UnreadWeights | None) -> dict[str, int]:
    """Serve each MoE's experts that `gguf_expert_targets` left unread from the GGUF's blocks (see the
    module docstring). Returns how many expert stacks took each form.

    With the native kernels the packs are the machine's one copy, as the projections' are
    (baton.model.packed_cache): the first worker streams them into a file, a stack at a time (each
    pack freed once written), and every worker maps it; a worker that finds the file repacks and
    reads nothing, so workers loading at once never each hold the experts privately."""
    gguf_path = source.path
    stacks = _stacks(model, source)
    if not stacks:
        return {}
    sizes = [moe.num_experts for _, moe, _, _ in stacks]
    slots: list[PackedSlot] = []
    ops: list[QuantizedLinear] = []
    shared = _shared_packs(gguf_path, stacks, kernels)
    how = "repacked privately"
    if shared is not None:
        with shared.locked():
            mapped = shared.read(sum(sizes))
            how = "mapped from"
            if mapped is None or not _fits(mapped, stacks):
                mapped = shared.write(slot for slot, _ in _packs(source, stacks, kernels, unread))
                how = "written to"
            if mapped is not None:
                slots = mapped
                ops = [QuantizedLinear.from_packed(slot.scheme, slot.packed, slot.out_features, slot.in_features,
                                                   None, kernels) for slot in mapped]
    if not ops:
        for slot, op in _packs(source, stacks, kernels, unread):
            slots.append(dataclasses.replace(slot, packed=None))
            ops.append(op)
    counts: collections.Counter[str] = collections.Counter()
    start = 0
    by_moe: dict[str, dict[str, list[QuantizedLinear]]] = {}
    for (name, moe, kind, _), size in zip(stacks, sizes, strict=True):
        by_moe.setdefault(name, {})[kind] = ops[start:start + size]
        counts[slots[start].label] += 1
        start += size
    for name, moe, _, _ in stacks[::2]:
        moe.use_quantized_experts(by_moe[name]["experts_gate_up"], by_moe[name]["experts_down"])
    where = f" {shared.data_path}" if shared is not None and how != "repacked privately" else ""
    logger.info("GGUF %s: MoE experts served in the file's own blocks: %s (%s%s)", gguf_path.name,
                ", ".join(f"{n} {t} stacks" for t, n in sorted(counts.items())), how, where)
    return dict(counts)


def _fits(mapped: list[PackedSlot], stacks: list[Stack]) -> bool:
    """The file's slots have the experts' kinds and shapes (else: repacked, never served)."""
    expected = []
    for _, moe, kind, _ in stacks:
        hidden, width = moe.hidden, moe.intermediate
        shape = (2 * width, hidden) if kind == "experts_gate_up" else (hidden, width)
        expected += [shape] * moe.num_experts
    return len(mapped) == len(expected) and all(
        slot.packed is not None and slot.scheme in QuantizedLinear.SCHEMES
        and (slot.out_features, slot.in_features) == shape for slot, shape in zip(mapped, expected))
