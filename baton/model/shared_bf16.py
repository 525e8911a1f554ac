"""One copy of a bf16 model's packed projections per machine, shared by every worker (issue 42).

With the native bf16 matmul (AVX512-BF16 or AMX) each projection's only copy is its pack in the
kernel's layout (`RowSplitLinear`, baton.model.linear: `gemv_pack`). Each worker used to hold its own:
N workers on one machine, N copies of the model. As for a GGUF's repacked blocks
(baton.model.packed_cache, whose file format, lock and read-only mapping this reuses), the first
worker to load a model writes its packs once to `$BATON_CACHE/packed/<key>.bin`, and every worker
swaps its private packs for views of that file, mapped read-only: the pages are the page cache's,
counted once across the processes that map them. A worker that finds the file still packs at load
(the agreement probe of each shape needs the op) and then drops its private packs; what it keeps is
its KV pool and its activations.

The key is a hash of what decides the bytes: the checkpoint's content (each safetensors file's
header and the ends of its data, or a GGUF's content key), the weights' dtype, the kernel's pack
layout (`LAYOUT`) and each projection's name and shape (the loader's fusions: q|k|v, gate|up).
`BATON_PACKED_CACHE=off` keeps the private packs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from baton.model import packed_cache
from baton.model.linear import RowSplitLinear
from baton.model.packed_cache import PackedSlot, SharedPacks

logger = logging.getLogger("baton.model.shared_bf16")

LAYOUT = "gemv_pack:[ceil(out/64), in/2, 64, 2] bf16, v1"
SCHEME = "bf16"  # PackedSlot.scheme of a native bf16 pack (its bytes: the pack viewed as uint8)
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


def share_native_packs(model: nn.Module, model_dir: Path, gguf: Path | None) -> int:
    """Swap the model's private native bf16 packs for views of the machine's one file (written here
    if it is not there yet). Returns the bytes now shared (0: nothing packed, sharing off, or the
    cache unusable: the worker keeps its own packs, said in the log)."""
    ops = native_packs(model)
    if not ops or not packed_cache.enabled():
        return 0
    layout = {"layout": LAYOUT, "dtype": "bfloat16",
              "slots": [[label, op.out_features, op.in_features, op.bias is not None] for label, op in ops]}
    try:
        material = json.dumps({"weights": checkpoint_key(model_dir, gguf), **layout}, sort_keys=True)
        shared = SharedPacks("bf16-" + hashlib.sha256(material.encode()).hexdigest()[:32])
    except OSError as exc:
        logger.warning("no shared bf16 weights (%s): this worker keeps its own copy", exc)
        return 0
    with shared.locked():
        mapped = shared.read(len(ops))
        verb = "mapped from"
        if mapped is None or not _fits(mapped, ops):
            mapped = shared.write([PackedSlot("bf16", SCHEME, op.out_features, op.in_features,
                                              op.packed.view(torch.uint8)) for _, op in ops])
            verb = "written to"
            if mapped is None:
                return 0  # (the disk refused: said by SharedPacks)
    total = 0
    for (_, op), slot in zip(ops, mapped, strict=True):
        assert slot.packed is not None
        op.packed = slot.packed.view(torch.bfloat16).view(op.packed.shape)  # the private pack is freed
        total += slot.packed.numel()
    logger.info("bf16 weights: %d packed projections (%.0f MB) %s %s (one copy per machine)", len(ops),
                total / 1e6, verb, shared.data_path)
    return total


def _fits(mapped: list[PackedSlot], ops: list[tuple[str, Any]]) -> bool:
    """The file's packs have these projections' shapes and sizes (else: written anew, never served)."""
    for (_, op), slot in zip(ops, mapped, strict=True):
        if (slot.scheme != SCHEME or slot.packed is None
                or (slot.out_features, slot.in_features) != (op.out_features, op.in_features)
                or slot.packed.numel() != op.packed.numel() * op.packed.element_size()):
            return False
    return True
