"""A GGUF's projections served in its own quantization, as llama.cpp serves them.

A `.gguf` model becomes a small Hugging Face directory once (`baton.common.model_files`: the config,
the tokenizer, a record of the file; no weights), and the loader reads the tensors from the file
itself (`baton.model.gguf_checkpoint`). With `--quantization auto` (the default) the projections the
file's blocks can serve are not read by the loader at all (`gguf_projection_targets`, left on the meta
device: decision 30); `load_gguf_projections` gives each dense projection the GGUF's own blocks,
repacked for the native kernels (`kernels/qgemv.cpp`) without requantizing:

- Q8_0: int8 + one fp16 scale per 32 (the int8 kernel's format, scale widened to fp32);
- Q4_0, Q4_1, Q4_K: 4-bit, each block of 32 as w = d * q + m (Q4_0: m = -8 d; Q4_K's sub-blocks:
  d = d_super * scale, m = -dmin * min, rounded to fp16 as the 4-bit kernel stores them);
- any other quantized type (Q5_*, Q6_K, Q2_K, Q3_K, IQ*) and a fused projection whose parts differ
  in type (Q4_K_M's attn_v and ffn_down are Q6_K): dequantized by `gguf` and requantized to Q8_0
  (8 bits for a 5-6 bit source: near-lossless), said in the log with the counts;
- F16, BF16, F32 projections stay dense in the model's dtype.

Rows are mapped and un-permuted as transformers does (its GGUF tensor processors: Llama's q and k
rows are stored permuted for llama.cpp's RoPE), and every repacked projection is checked against
transformers' dequantization of the same tensor (read then, one at a time) on a sample of rows: a
mapping mistake is an error at load, never wrong text. MoE experts are served in their blocks too
(baton.model.gguf_experts).

The packs are written once per machine and mapped read-only by every worker
(`baton.model.packed_cache`): a worker that finds them maps the file and repacks nothing (the check
ran when they were written), so N workers hold one copy of the projections, in the page cache.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from baton.common.gguf_llama_like import tensor_processor_arch
from baton.model import packed_cache
from baton.model.linear import QuantizedLinear
from baton.model.packed_cache import PackedSlot, SharedPacks
from baton.model.model import set_op
from baton.model.q_blocks import quantize_q8_0
from baton.model.gguf_checkpoint import drop_touched_pages, open_reader
from baton.model.gguf_mapped import MappedGGUFTensors, uses_conversion_mapping
from baton.model.loader import UnreadWeights, checkpoint_names

logger = logging.getLogger("baton.model.gguf_weights")

DENSE_TYPES = ("F32", "F16", "BF16")
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _fp16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def unpack_q8_0(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 rows [n, k/32 * 34] uint8 -> (q [n, k] int8, d [n, k/32] fp32)."""
    blocks = raw.reshape(n, k // 32, 34)
    d = _fp16(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
    return torch.from_numpy(q.copy()), torch.from_numpy(d)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: elements 0-15 are the low nibbles, 16-31 the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack_q4(raw: np.ndarray, type_name: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 / Q4_1 / Q4_K rows -> (q [n, k] uint8 in 0..15, d, m [n, k/32] fp32), w = d * q + m."""
    if type_name == "Q4_0":
        blocks = raw.reshape(n, k // 32, 18)
        d = _fp16(blocks[..., 0:2])
        m = -8.0 * d
        q = _nibbles(blocks[..., 2:])
    elif type_name == "Q4_1":
        blocks = raw.reshape(n, k // 32, 20)
        d, m = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
        q = _nibbles(blocks[..., 4:])
    elif type_name == "Q4_K":
        supers = raw.reshape(n, k // 256, 144)
        d_super, dmin = _fp16(supers[..., 0:2]), _fp16(supers[..., 2:4])
        sc = supers[..., 4:16].astype(np.uint8)
        # llama.cpp's get_scale_min_k4: 8 6-bit scales and mins in 12 bytes
        scales = np.empty(sc.shape[:-1] + (8,), np.float32)
        mins = np.empty_like(scales)
        scales[..., :4] = sc[..., 0:4] & 63
        mins[..., :4] = sc[..., 4:8] & 63
        scales[..., 4:] = (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)
        mins[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
        d = (d_super[..., None] * scales).reshape(n, k // 32)
        m = (-dmin[..., None] * mins).reshape(n, k // 32)
        qs = supers[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64: low nibbles, then high
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k // 32, 32)
    else:
        raise ValueError(f"{type_name} is not a 4-bit type this kernel takes")
    return (torch.from_numpy(np.ascontiguousarray(q).reshape(n, k).astype(np.uint8)),
            torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32)))


class GGUFTensors:
    """The GGUF file's tensors by name, with the row order transformers gives them."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        import gguf
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = path

        self.reader = open_reader(path)  # the loader's, when it read the weights from this file
        self.arch = bytes(self.reader.fields["general.architecture"].parts[-1]).decode()
        self.tensors = {t.name: t for t in self.reader.tensors}
        # Qwen3.5: rows ordered by transformers' conversion mapping (baton.model.gguf_mapped)
        self._mapped: MappedGGUFTensors | None = None
        if uses_conversion_mapping(self.arch):
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            self._mapped = MappedGGUFTensors(self.reader, self.arch, config)
        processor = TENSOR_PROCESSORS.get(tensor_processor_arch(self.arch), TensorProcessor)
        self._processor = processor(config={"num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads})
        arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch), None)
        if arch is None:
            raise ValueError(f"the gguf package knows no architecture {self.arch!r}")
        blocks = 1 + max((int(n.split(".")[1]) for n in self.tensors if n.startswith("blk.")), default=0)
        self.names = gguf.get_tensor_name_map(arch, blocks)

    @classmethod
    def of(cls, model: nn.Module, path: Path) -> GGUFTensors:
        """The file's tensors for `model` (its heads say how q and k rows were permuted): one per load,
        shared by the projections', experts' and tables' readers (a Qwen3.5 file's reads its config)."""
        return cls(path, model.config.num_heads, model.config.num_kv_heads)

    def find(self, hf_name: str) -> Any | None:
        """The tensor a Hugging Face module name (`model.layers.0.self_attn.q_proj`) maps to."""
        name = self.names.get_name(hf_name)
        return None if name is None else self.tensors.get(name + ".weight")

    def type_name(self, tensor: Any) -> str:
        return tensor.tensor_type.name

    def shape(self, tensor: Any) -> tuple[int, int]:
        k, n = (int(x) for x in tensor.shape)  # ggml lists the fastest-varying dimension first
        return n, k

    def servable(self, tensor: Any) -> bool:
        """Whether the tensor's blocks, reordered by rows or read with its input reordered, are the
        weight (not where its conversion changes values: `MappedGGUFTensors.row_order`)."""
        return (self._mapped is None or self._mapped.row_order(tensor.name, self.shape(tensor)[0]) is not None
                or self.input_order(tensor) is not None)

    def input_order(self, tensor: Any) -> np.ndarray | None:
        """The order to read a projection's input in, where its conversion reorders the columns only
        (Qwen3.5's out_proj): its blocks are served as stored (`QuantizedLinear.input_order`)."""
        return None if self._mapped is None else self._mapped.input_order(tensor.name)

    def rows(self, tensor: Any) -> np.ndarray:
        """[n, bytes per row] uint8 (or [n, k] floats for dense types), in transformers' row order
        (as stored where the conversion reorders columns instead: `input_order`)."""
        n, _ = self.shape(tensor)
        data = np.asarray(tensor.data)
        data = data.reshape(n, -1)
        if self._mapped is not None and self.input_order(tensor) is not None:
            return data
        order = self.row_order(tensor)
        return data if np.array_equal(order, np.arange(n)) else data[order]

    def row_order(self, tensor: Any) -> np.ndarray:
        """Which stored row each of transformers' rows is (its conversion's permutation of them)."""
        n, _ = self.shape(tensor)
        if self._mapped is not None:
            order = self._mapped.row_order(tensor.name, n)
            assert order is not None, f"{tensor.name}'s conversion is not a row order"
            return order
        order = self._processor.process(weights=np.arange(n).reshape(n, 1), name=tensor.name).weights
        return np.asarray(order).reshape(n)

    def dequantized(self, tensor: Any) -> torch.Tensor:
        import gguf

        n, k = self.shape(tensor)
        rows = self.rows(tensor)
        if self.type_name(tensor) in DENSE_TYPES:
            return torch.from_numpy(np.ascontiguousarray(rows).astype(np.float32)).reshape(n, k)
        return torch.from_numpy(gguf.quants.dequantize(rows, tensor.tensor_type).astype(np.float32)).reshape(n, k)


def served_parts(types: list[str], shapes: list[tuple[int, int]], rows: Callable[[int], np.ndarray],
                 dequantized: Callable[[int], torch.Tensor]) -> tuple[str, tuple[torch.Tensor, ...], bool]:
    """The kernel op's scheme and parts for quantized tensors of these types and [n, k] shapes, joined
    along the rows: Q8_0 or 4-bit blocks as stored (`rows(i)`: tensor i's rows of blocks), any other
    type or a mix dequantized (`dequantized(i)`) and requantized to Q8_0 (then the third item is True)."""
    if all(t == "Q8_0" for t in types):
        unpacked = [unpack_q8_0(rows(i), n, k) for i, (n, k) in enumerate(shapes)]
        return "q8_0", tuple(torch.cat(ps) for ps in zip(*unpacked)), False
    if all(t in FOUR_BIT_TYPES for t in types):
        unpacked4 = [unpack_q4(rows(i), t, n, k) for i, (t, (n, k)) in enumerate(zip(types, shapes))]
        return "q4", tuple(torch.cat(ps) for ps in zip(*unpacked4)), False
    weight = torch.cat([dequantized(i) for i in range(len(types))])
    return "q8_0", quantize_q8_0(weight), True


def _slot_sources(model: nn.Module) -> list[list[list[str]]]:
    """Per projection slot (`model.projection_slots()`, in its order), the alternatives of Hugging Face
    module names it is made of, as the loader's recipe for its weight names them (`checkpoint_names`):
    separate parts (q, k, v; gate, up), then an already fused tensor (Phi-3), each family's own spelling
    (LFM2's `conv.in_proj`, Qwen2-MoE's `shared_expert`), a tied head as the embedding's tensor."""
    names = {id(module): name for name, module in model.named_modules()}
    recipes = checkpoint_names(model, model.config)
    out: list[list[list[str]]] = []
    for _, _, linear in model.projection_slots():
        name = names[id(linear)]
        if name == "lm_head":
            out.append([["lm_head"], ["model.embed_tokens"]])  # a tied head is the embedding's tensor
            continue
        alternatives = recipes[f"{name}.weight"]
        assert all(len(parts) == 1 for parts in alternatives), f"{name} is not one tensor or a concatenation"
        # separate parts first: llama.cpp names a fused gate|up (Phi-3) `ffn_up`, as it does a separate up
        modules = [[f"model.{n.removesuffix('.weight')}" for n in parts[0]] for parts in alternatives]
        out.append(sorted(modules, key=len, reverse=True))
    return out


def _check(parts: tuple[torch.Tensor, ...], scheme: str, loaded: torch.Tensor,
           where: str) -> None:
    """The repacked weight must be the one the loader read (dequantized by transformers from the same
    blocks, rounded to the model's dtype), on a sample of rows: anything else is a mapping error."""
    n = loaded.shape[0]
    rows = torch.unique(torch.linspace(0, n - 1, min(n, 64)).long())
    sampled = tuple(p[rows] for p in parts)
    probe = QuantizedLinear(scheme, sampled, None, kernels=None)
    mine = probe.dequantized(torch.float32)
    theirs = loaded[rows].float()
    tolerance = 2.0 ** -7 * theirs.abs().amax().item() + 1e-6  # bf16 rounding, and fp16 for Q4_K scales
    if not torch.allclose(mine, theirs, rtol=2.0 ** -7, atol=tolerance):
        worst = (mine - theirs).abs().max().item()
        raise ValueError(f"the GGUF's {where} does not match the converted weights (max error {worst:.3g}): "
                         "its tensors were mapped wrongly")


Slot = tuple[tuple[Any, str, Any], list[list[str]]]  # ((owner, name, linear), its tensors' alternatives)


def gguf_projection_targets(model: nn.Module, source: GGUFTensors) -> set[str]:
    """The parameter names of the projections the GGUF's blocks will serve (every slot not wholly
    dense in the file): the loader leaves them unread (`loader.load_model_deferring`), so that a
    worker never holds the dequantized model beside its packs (the MoE experts' stacks too:
    baton.model.gguf_experts.gguf_block_targets)."""
    slots, sources = model.projection_slots(), _slot_sources(model)
    if len(slots) != len(sources):  # a layout this repack does not know: it says so when it runs
        return set()
    names = {id(module): name for name, module in model.named_modules()}
    targets = set()
    for (_, _, linear), alternatives in zip(slots, sources, strict=True):
        tensors = _slot_tensors(source, alternatives)
        if (tensors is not None and not all(source.type_name(t) in DENSE_TYPES for t in tensors)
                and all(source.servable(t) for t in tensors)):
            targets.add(names[id(linear)] + ".weight")
    return targets


def load_gguf_projections(model: nn.Module, source: GGUFTensors, kernels: Any,
                          unread: UnreadWeights | None = None) -> dict[str, int]:
    """Replace `model`'s dense projections by the GGUF's blocks (see the module docstring); the
    projections' dense weights are freed (or were never read: `unread` holds those the loader left
    on the meta device, read one at a time for the check). Returns how many projections took each form.

    With the native kernels the packs are the machine's one copy (baton.model.packed_cache): mapped
    read-only from the file that the first worker to load this GGUF wrote, so that N workers on one
    machine hold the weights once, in the page cache. The first worker streams its repack into that
    file, each pack freed once written, so that loading peaks at one projection's pack, not all."""
    gguf_path = source.path
    slots: list[Slot] = list(zip(model.projection_slots(), _slot_sources(model), strict=True))
    shared = _shared_packs(gguf_path, model, slots, kernels)
    if shared is not None:
        with shared.locked():
            mapped = shared.read(len(slots))
            how = "mapped from"
            if mapped is None or not _fits(mapped, slots):
                mapped = shared.write(slot for slot, _ in _packs(model, source, slots, kernels, unread))
                how = "written to"
            if mapped is not None:
                _serve_mapped(model, slots, mapped, kernels)
                logger.info("GGUF %s: %d packed projections %s %s, which every worker maps (one copy per machine)",
                            gguf_path.name, sum(m.packed is not None for m in mapped), how, shared.data_path)
                return _counts(mapped)
    made: list[PackedSlot] = []
    for ((owner, name, linear), _), (slot, op) in zip(slots, _packs(model, source, slots, kernels, unread),
                                                      strict=True):
        if op is not None:
            set_op(owner, name, op)
            model.drop_projection_weight(linear)
        made.append(slot)
    return _counts(made)


def _counts(slots: list[PackedSlot]) -> dict[str, int]:
    return dict(collections.Counter(slot.label for slot in slots))


def shared_packs_file(gguf_path: Path, layout: dict[str, Any], kernels: Any, what: str) -> SharedPacks | None:
    """The machine's cache file of packs made from this GGUF in `layout` (with the kernels' ISA and
    transformers' version), where the native kernels pack (else None: each worker packs its own)."""
    if kernels is None or not kernels.q8_available() or not packed_cache.enabled():
        return None
    import transformers

    layout = layout | {"isa": kernels.qgemv_isa(), "transformers": transformers.__version__}
    try:
        return SharedPacks(packed_cache.cache_key(gguf_path, layout))
    except OSError as exc:
        logger.warning("GGUF %s: no shared %s (%s): this worker keeps its own copy", gguf_path.name, what, exc)
        return None


def _shared_packs(gguf_path: Path, model: nn.Module, slots: list[Slot], kernels: Any) -> SharedPacks | None:
    config = model.config
    # what decides the bytes besides the file: the rows' order (transformers' un-permutation, by the
    # head counts) and which tensors make each slot; the check against the loaded weights runs only
    # when the packs are made, so a transformers upgrade packs anew rather than trusting old bytes
    layout = {"heads": [config.num_heads, config.num_kv_heads], "slots": [alternatives for _, alternatives in slots]}
    return shared_packs_file(gguf_path, layout, kernels, "packed weights")


def _fits(mapped: list[PackedSlot], slots: list[Slot]) -> bool:
    """Whether the cached packs have the model's projection shapes (a key collision, or a cache file
    from another model of the same GGUF, is repacked, never served)."""
    for ((_, _, linear), _), slot in zip(slots, mapped, strict=True):
        if slot.packed is not None and (slot.out_features, slot.in_features) != tuple(linear.weight.shape):
            return False
    return True


def _serve_mapped(model: nn.Module, slots: list[Slot], mapped: list[PackedSlot], kernels: Any) -> None:
    for ((owner, name, linear), _), slot in zip(slots, mapped, strict=True):
        if slot.packed is None:
            continue  # a dense projection: the model's own weight
        assert slot.scheme is not None
        op = QuantizedLinear.from_packed(slot.scheme, slot.packed, slot.out_features, slot.in_features,
                                         linear.bias, kernels)
        if slot.input_order is not None:
            op.input_order = torch.tensor(slot.input_order, dtype=torch.long)
        set_op(owner, name, op)
        model.drop_projection_weight(linear)


def _slot_tensors(source: GGUFTensors, alternatives: list[list[str]]) -> list[Any] | None:
    found = [[source.find(h) for h in alt] for alt in alternatives]
    return next((ts for ts in found if all(t is not None for t in ts)), None)


def _packs(model: nn.Module, source: GGUFTensors, slots: list[Slot], kernels: Any,
           unread: UnreadWeights | None) -> Iterator[tuple[PackedSlot, QuantizedLinear | None]]:
    """Each slot's blocks unpacked, checked against the loaded weight and packed for the kernels,
    one slot at a time (the file's pages each slot touched are unmapped after it)."""
    names = {id(module): name for name, module in model.named_modules()}
    made: list[PackedSlot] = []
    requantized: collections.Counter[str] = collections.Counter()
    for (_, _, linear), alternatives in slots:
        tensors = _slot_tensors(source, alternatives)
        if tensors is None:
            raise ValueError(f"the GGUF has no tensor for {alternatives[0]} (architecture {source.arch})")
        types = [source.type_name(t) for t in tensors]
        where = "+".join(t.name for t in tensors)
        if all(t in DENSE_TYPES for t in types):
            made.append(PackedSlot("dense"))
            yield made[-1], None
            continue
        if not all(source.servable(t) for t in tensors):  # its conversion changes values: dequantized
            made.append(PackedSlot("+".join(sorted(set(types))) + " dequantized"))
            yield made[-1], None
            continue
        orders = [source.input_order(t) for t in tensors]
        order = orders[0] if len(tensors) == 1 else None
        if any(o is not None for o in orders) and order is None:
            raise ValueError(f"the GGUF's {where}: parts whose columns are reordered cannot be joined")
        scheme, parts, requantizes = served_parts(types, [source.shape(t) for t in tensors],
                                                  lambda i: source.rows(tensors[i]),
                                                  lambda i: source.dequantized(tensors[i]))
        if requantizes:
            requantized["/".join(sorted(set(types)))] += 1
        if tuple(parts[0].shape) != tuple(linear.weight.shape):
            raise ValueError(f"the GGUF's {where} is {tuple(parts[0].shape)}, the model's projection "
                             f"{tuple(linear.weight.shape)}")
        target = names[id(linear)] + ".weight"
        loaded = unread.read(target) if linear.weight.is_meta and unread is not None else linear.weight
        # blocks with their columns as stored: the loaded weight's columns read in the input's order
        _check(parts, scheme, loaded if order is None else loaded[:, torch.from_numpy(order)], where)
        del loaded
        op = QuantizedLinear(scheme, parts, linear.bias, kernels)
        if order is not None:
            op.input_order = torch.from_numpy(order).long()
        del parts
        drop_touched_pages(source.reader)
        made.append(PackedSlot("+".join(sorted(set(types))) + (" (input reordered)" if order is not None else ""),
                               scheme, op.out_features, op.in_features, op.packed,
                               None if order is None else order.tolist()))
        yield made[-1], op
        # counted, not held: the consumer keeps what it needs (a streamed pack is freed once written)
        made[-1] = dataclasses.replace(made[-1], packed=None)
        del op
    if requantized:
        logger.info("GGUF %s: %s requantized to Q8_0 (no native kernel for those types yet)", source.path.name,
                    ", ".join(f"{n} {t}" for t, n in sorted(requantized.items())))
    logger.info("GGUF %s served in its own quantization: %s", source.path.name,
                ", ".join(f"{n} {t}" for t, n in sorted(_counts(made).items())))
