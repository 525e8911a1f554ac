"""One copy of a model's served weights per machine, shared by every worker (issue 42).

Each worker used to hold its own copy of every weight it serves: N workers on one machine, N copies
of the model. As for a GGUF's repacked blocks (baton.model.packed_cache, whose file format, lock and
read-only mapping this reuses), the first worker to load a model writes what its ops read once to
`$BATON_CACHE/packed/<key>.bin`, and every worker swaps its private copies for views of that file,
mapped read-only: the pages are the page cache's, counted once across the processes that map them.
What a worker keeps of its own is its KV pool and its activations. Three kinds of copy are shared:

- the native bf16 matmul's packs (AVX512-BF16 or AMX: `RowSplitLinear`, baton.model.linear's
  `gemv_pack`), each projection's only copy there;
- the dense weights F.linear reads (a projection whose op is its nn.Linear): float32 wherever bf16
  has no instructions (`--dtype auto` on AMD Zen 3 or an Intel CPU without AVX512-BF16 loads
  float32, twice the checkpoint's bytes per worker) and bf16 where oneDNN cannot pack it;
- the token embeddings' tables (nn.Embedding: the input embedding where the head does not serve its
  lookups, Gemma 4's per-layer embeddings), whatever the projections are (a GGUF's are read from the
  file's own rows under `--quantization auto`: baton.model.gguf_embeddings);
- a MoE's experts: the dense stacks the experts' F.linear reads (a safetensors MoE under `auto`, a
  GGUF's experts, which keep the model's dtype), or their native Q8_0 packs (gpt-oss's MXFP4
  repacked, `--quantization int8/int4` quantizing them at load); the experts are most of such a
  model's bytes;
- the native quantized packs `--quantization int8/int4` makes of a safetensors checkpoint's
  projections at load (a GGUF's are mapped from its own shared file already: `QuantizedLinear.shared`).

A worker that finds the file still builds its ops at load (the agreement probe of each shape needs
them) and then drops its private copies. The key is a hash of what decides the bytes: the
checkpoint's content (each safetensors file's header and the ends of its data, or a GGUF's content
key), the pack layout (`LAYOUT`), each slot's name, kind, dtype and shape, and samples of each
tensor this load made (another version of the loader's transforms or of the pack never maps an older
file). The file is the size of what it holds (a 1B model in float32: 4.7 GB, written once, in
seconds); a disk that refuses it leaves each worker its own copy, said in the log.
`BATON_PACKED_CACHE=off` keeps the private copies.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

from baton.model import packed_cache
from baton.model.linear import QuantizedLinear, RowSplitLinear
from baton.model.moe import SparseMoE
from baton.model.packed_cache import PackedSlot, SharedPacks

logger = logging.getLogger("baton.model.shared_weights")

LAYOUT = ("gemv_pack:[ceil(out/64), in/2, 64, 2] bf16; dense: the tensor's bytes; quant: q8_pack/q4_pack "
          f"v{packed_cache.LAYOUT_VERSION}; v3")
SCHEME = "bf16"  # PackedSlot.scheme of a native bf16 pack (its bytes: the pack viewed as uint8)
QUANT_SCHEME = "quant:"  # + QuantizedLinear.scheme: a native quantized pack (its bytes as they are)
SAMPLE_BYTES = 4096


def checkpoint_key(model_dir: Path, gguf: Path | None) -> str:
    """What ties the packs to the weights: a GGUF's content key, or each safetensors file's size,
    header and the two ends of its data (a fine-tune changes every tensor, so both ends)."""
    if gguf is not None:
        from baton.common.gguf_key import gguf_content_key

        return gguf_content_key(gguf)
    digest = hashlib.sha256()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no safetensors files")
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = f.read(header_len)
            start = 8 + header_len
            f.seek(start)
            head = f.read(SAMPLE_BYTES)
            f.seek(max(start, size - SAMPLE_BYTES))
            tail = f.read(SAMPLE_BYTES)
        for part in (path.name.encode(), str(size).encode(), header, head, tail):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return "safetensors-v1:" + digest.hexdigest()


def native_packs(model: nn.Module) -> list[tuple[str, RowSplitLinear]]:
    """The projections whose only copy is a native bf16 pack (the batch-invariant ops)."""
    out = []
    for owner, name, _ in model.projection_slots():
        op = getattr(owner, name)
        if isinstance(op, RowSplitLinear) and op.large is None:
            out.append((f"{type(owner).__name__}.{name}", op))
    return out


def quantized_packs(model: nn.Module) -> list[tuple[str, QuantizedLinear]]:
    """The native quantized ops this load packed in the worker's own memory: projections quantized
    at load and MoE experts' ops (one per expert and kind), once each; those mapped from a shared
    file already (a GGUF's) are left."""
    ops: list[tuple[str, object]] = [(f"{type(owner).__name__}.{name}", getattr(owner, name))
                                     for owner, name, _ in model.projection_slots()]
    for moe_name, moe in model.named_modules():
        if isinstance(moe, SparseMoE) and moe.expert_ops is not None:
            for expert, pair in enumerate(moe.expert_ops):
                ops += [(f"{moe_name}.experts.{expert}.{kind}", op) for kind, op in zip(("gate_up", "down"), pair)]
    out: dict[int, tuple[str, QuantizedLinear]] = {}
    for label, op in ops:
        if isinstance(op, QuantizedLinear) and op.packed is not None and not op.shared:
            out.setdefault(id(op), (label, op))
    return list(out.values())


def dense_tensors(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The dense weights the forward reads as they are: each projection whose op is its own
    nn.Linear (F.linear on the weight), each nn.Embedding's table and each MoE's dense expert
    stacks; once each (a tied head is its embedding), by parameter name, of a page or more and on
    the CPU."""
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    candidates = [linear.weight for owner, op_name, linear in model.projection_slots()
                  if getattr(owner, op_name) is linear]
    candidates += [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    candidates += [stack for m in model.modules() if isinstance(m, SparseMoE) and m.expert_ops is None
                   for stack in (m.experts_gate_up, m.experts_down)]
    out: dict[int, tuple[str, nn.Parameter]] = {}
    for param in candidates:
        if (param.device.type == "cpu" and not param.is_meta and param.numel() * param.element_size() >= MIN_DENSE_BYTES
                and param.dtype.is_floating_point and id(param) in names):
            out.setdefault(id(param), (names[id(param)], param))
    return list(out.values())


def share_weights(model: nn.Module, model_dir: Path, gguf: Path | None) -> int:
    """Swap the model's private native bf16 packs and dense weights (`dense_tensors`) for views of
    the machine's one file (written here if it is not there yet). Returns the bytes now shared (0:
    nothing to share, sharing off, or the cache unusable: the worker keeps its own copies, said in
    the log). Call it once the load-time copies are released and before the layers plan is built
    (the plan keeps references to what the ops read)."""
    packs = native_packs(model)
    dense = dense_tensors(model)
    quantized = quantized_packs(model)
    if not (packs or dense or quantized) or not packed_cache.enabled():
        return 0
    slots = ([[label, SCHEME, op.out_features, op.in_features] for label, op in packs]
             + [[name, dense_scheme(p.dtype), *p.shape] for name, p in dense]
             + [[label, QUANT_SCHEME + op.scheme, op.out_features, op.in_features] for label, op in quantized])
    # (scheme, tensor, out_features, in_features) of each slot: packs, dense tensors, quantized packs
    wanted = ([(SCHEME, op.packed, op.out_features, op.in_features) for _, op in packs]
              + [(dense_scheme(p.dtype), p.detach(), p.shape[0], p[0].numel()) for _, p in dense]
              + [(QUANT_SCHEME + op.scheme, op.packed, op.out_features, op.in_features) for _, op in quantized])
    # the samples tie the file to what this load made, not only to the checkpoint: another version of
    # the loader's transforms or of the kernels' pack gets its own file, never the old numbers
    layout = {"layout": LAYOUT, "slots": slots, "samples": _sample_digest([t for _, t, _, _ in wanted])}
    try:
        material = json.dumps({"weights": checkpoint_key(model_dir, gguf), **layout}, sort_keys=True)
        shared = SharedPacks("weights-" + hashlib.sha256(material.encode()).hexdigest()[:32])
    except OSError as exc:
        logger.warning("no shared weights (%s): this worker keeps its own copy", exc)
        return 0
    with shared.locked():
        mapped = shared.read(len(wanted))
        verb = "mapped from"
        if mapped is None or not _fits(mapped, wanted):
            mapped = shared.write(PackedSlot(scheme, scheme, out, inner, _bytes(t)) for scheme, t, out, inner in wanted)
            verb = "written to"
            if mapped is None:
                return 0  # (the disk refused: said by SharedPacks)
    total = 0
    for (_, op), slot in zip(packs, mapped[:len(packs)], strict=True):
        assert slot.packed is not None
        op.packed = slot.packed.view(torch.bfloat16).view(op.packed.shape)  # the private pack is freed
        total += slot.packed.numel()
    for (_, param), slot in zip(dense, mapped[len(packs):len(packs) + len(dense)], strict=True):
        assert slot.packed is not None
        _swap(model, param, nn.Parameter(slot.packed.view(param.dtype).view(param.shape), requires_grad=False))
        total += slot.packed.numel()
    for (_, qop), slot in zip(quantized, mapped[len(packs) + len(dense):], strict=True):
        assert slot.packed is not None and qop.packed is not None
        qop.share_pack(slot.packed.view(qop.packed.shape))  # the private pack is freed
        total += slot.packed.numel()
    what = ", ".join(part for part in (f"{len(packs)} native bf16 packs" if packs else "",
                                       f"{len(dense)} dense tensors" if dense else "",
                                       f"{len(quantized)} quantized packs" if quantized else "") if part)
    logger.info("weights: %s (%.0f MB) %s %s (one copy per machine)", what, total / 1e6, verb, shared.data_path)
    return total


MIN_DENSE_BYTES = packed_cache.ALIGN  # each slot takes whole pages: a smaller tensor (a norm, a bias) stays private


def dense_scheme(dtype: torch.dtype) -> str:
    return "dense:" + str(dtype).removeprefix("torch.")


SAMPLE_STRIDED = 16384  # bytes taken across each tensor for the key, beside its first and last SAMPLE_BYTES


def _sample_digest(tensors: list[torch.Tensor]) -> str:
    """A hash of each tensor's first and last SAMPLE_BYTES and SAMPLE_STRIDED bytes spread across it
    (milliseconds for a whole model)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        flat = _bytes(tensor)
        n = flat.numel()
        step = max(1, n // SAMPLE_STRIDED)
        for part in (flat[:SAMPLE_BYTES], flat[max(0, n - SAMPLE_BYTES):], flat[::step][:SAMPLE_STRIDED]):
            digest.update(part.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(torch.uint8).reshape(-1)


def _swap(model: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Every module holding `old` (a tied head and its embedding: both) holds `new` instead."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is old:
                module._parameters[name] = new


def _fits(mapped: list[PackedSlot], wanted: list[tuple[str, torch.Tensor, int, int]]) -> bool:
    """The file's slots have these kinds, shapes and sizes (else: written anew, never served)."""
    if len(mapped) != len(wanted):
        return False
    for (scheme, tensor, out, inner), slot in zip(wanted, mapped, strict=True):
        if (slot.scheme != scheme or slot.packed is None or (slot.out_features, slot.in_features) != (out, inner)
                or slot.packed.numel() != tensor.numel() * tensor.element_size()):
            return False
    return True
