"""What a prepared model will run, per step kind and per projection: the plan `prepare()` chose.

`prepare()` decides once (`baton.model.model.CausalLM.prepare`): each projection's op (a
oneDNN pack, the native few-row kernel up to some row count, quantized blocks, or plain torch), the
layer path (the native layer kernels or the torch ops around the matmuls), and for decode-only steps
whether one native call runs every layer (`LayersPlan`). The forward only reads those choices; this
module reads the same objects and says them in words, with the bytes each weight holds, so that
"one copy of each weight" can be checked by eye (`python -m baton.model.kernels --model M`). It first
states the forward-path choices `prepare()` was given (`PathChoices`: the runtime config's fields,
whose defaults are the environment's, baton/model/runtime_env.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.model.linear import ALL_ROWS, PackedLinear, QuantizedLinear, RowSplitLinear
from baton.model.moe_quant import experts_tensors, experts_words, moe_layers


@dataclass(frozen=True)
class PathChoices:
    """What `CausalLM.prepare` was asked (RuntimeConfig's fields) and what it resolved them to."""

    batch_invariant: str  # full, matmul or off (auto resolved)
    native_kernels: bool  # asked for (BATON_NATIVE_KERNELS)
    gemv_amx: bool  # asked for (BATON_GEMV_AMX)
    triton: bool  # the attention runs the Triton kernels (asked for by BATON_TRITON, and on CUDA)


def choice_lines(choices: PathChoices | None) -> list[str]:
    """The forward-path choices in words (none for a model `prepare()` never ran on)."""
    if choices is None:
        return []
    from baton.model import kernels

    module = kernels.loaded()
    if not choices.native_kernels:
        native = "off (the torch path everywhere)"
    elif module is None:
        native = "on, none built or used here (float32, another device, or no compiler: the torch path)"
    else:
        matmul = module.gemv_kernel("")
        native = f"on (bf16 matmul kernel: {matmul}, AMX {'allowed' if choices.gemv_amx else 'off'})"
    return ["choices (RuntimeConfig; defaults from BATON_* variables, baton/model/runtime_env.py):",
            f"  batch invariance: {choices.batch_invariant}",
            f"  native kernels: {native}",
            f"  Triton attention: {'on' if choices.triton else 'off'}"]


@dataclass(frozen=True)
class ProjectionPlan:
    kind: str  # qkv, o, gate_up, down, head
    count: int  # how many layers have it (1 for the head)
    kernel: str  # in words, with the row counts where it changes
    nbytes: int  # what these ops hold, all layers together


class _Bytes:
    """Counts each tensor's bytes once, whoever holds it (a pack may share the nn.Linear's weight,
    a tied head the embedding): keyed by where its data starts, not by its storage, since the packs
    and weights mapped from one shared file (baton.model.shared_weights, packed_cache) are views of
    one storage."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def add(self, *tensors: torch.Tensor | None) -> int:
        total = 0
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            try:
                key = t.data_ptr()
            except (RuntimeError, NotImplementedError):  # an opaque tensor: its own identity
                key = id(t)
            if key in self.seen:
                continue
            self.seen.add(key)
            total += t.numel() * t.element_size()
        return total


def op_tensors(op: object, linear: nn.Linear) -> list[torch.Tensor | None]:
    """Every tensor an op keeps for its weight and bias, with the nn.Linear's own (still held
    beside a pack until `release_load_copies`)."""
    tensors: list[torch.Tensor | None] = [linear.weight, linear.bias]
    if isinstance(op, QuantizedLinear):
        tensors += [op.packed, *op.parts, op.bias]
    elif isinstance(op, RowSplitLinear):
        tensors += [op.packed, op.bias]
        if op.large is not None:  # the tuned split's oneDNN pack beside it
            tensors += [op.large.packed, op.large.weight, op.large.bias]
    elif isinstance(op, PackedLinear):
        tensors += [op.packed, op.weight, op.bias]
    return tensors


def kernel_words(op: object, linear: nn.Linear) -> str:
    if op is linear:
        return f"torch F.linear ({linear.weight.dtype})"
    if isinstance(op, QuantizedLinear):
        blocks = {"q8_0": "Q8_0", "q4": "Q4 (4-bit, per-block scale and min)"}.get(op.scheme, op.scheme)
        how = f"native {op.isa} integer dot products" if op.native else "dequantized per call"
        return f"{blocks} blocks, {how}"
    if isinstance(op, RowSplitLinear):
        if op.max_native_rows >= ALL_ROWS:
            return "native bf16 few-row kernel for every row count (batch-invariant)"
        if op.max_native_rows <= 0:
            return "oneDNN bf16 pack for every row count"
        return f"native bf16 few-row kernel up to {op.max_native_rows} rows, oneDNN bf16 pack above"
    if isinstance(op, PackedLinear):
        return "oneDNN bf16 pack (prepacked)"
    return type(op).__name__


def projection_plans(model: nn.Module, counted: _Bytes | None = None) -> list[ProjectionPlan]:
    """One line per projection kind and kernel (layers that chose differently get their own line)."""
    counted = counted or _Bytes()
    grouped: dict[tuple[str, str], list[int]] = {}
    for owner, name, linear in model.projection_slots():
        op = getattr(owner, name)
        entry = grouped.setdefault((name, kernel_words(op, linear)), [0, 0])
        entry[0] += 1
        entry[1] += counted.add(*op_tensors(op, linear))
    return [ProjectionPlan(kind, count, kernel, nbytes) for (kind, kernel), (count, nbytes) in grouped.items()]


def expert_plans(model: nn.Module, counted: _Bytes | None = None) -> list[ProjectionPlan]:
    """One line per form the MoE layers' routed experts take (dense stacks, or Q8_0 ops per expert),
    with the bytes they hold (biases included)."""
    counted = counted or _Bytes()
    grouped: dict[str, list[int]] = {}
    for moe in moe_layers(model):
        entry = grouped.setdefault(experts_words(moe), [0, 0])
        entry[0] += 1
        entry[1] += counted.add(*experts_tensors(moe))
    return [ProjectionPlan("experts", count, words, nbytes) for words, (count, nbytes) in grouped.items()]


def step_plans(model: nn.Module) -> dict[str, str]:
    """Per step kind: what runs the layers."""
    # the first attention layer's (a hybrid's first layer may be a state layer, without KV)
    attn = next((layer.self_attn for layer in model.layers if getattr(layer, "self_attn", None) is not None), None)
    kv = attn.backend.kv_dtype if attn is not None else None
    attention = (f"native paged attention over the {str(kv).removeprefix('torch.')} KV cache" if kv is not None
                 else "native paged attention")
    layers = (f"native layer kernels (fused add + RMSNorm, {attention}, SiLU-mul)"
              if model.path == "native" else model.describe())
    decode = ("one native call for every layer (LayersPlan, kernels/decode_layers.cpp)"
              if getattr(model, "layers_plan", None) is not None else f"a Python loop over the layers: {layers}")
    return {"prefill": f"a Python loop over the layers: {layers}",
            "mixed (prefill chunks + decode rows)": f"a Python loop over the layers: {layers}",
            "decode-only": decode}


def other_weight_bytes(model: nn.Module, counted: _Bytes) -> int:
    """Everything but the projections (embedding, norms, MoE routers; the experts count once, whoever
    asks first: `expert_plans`)."""
    projections = {id(t) for _, _, linear in model.projection_slots() for t in (linear.weight, linear.bias)
                   if t is not None and t is not model.embed_tokens.weight}
    return counted.add(*(t for t in [*model.parameters(), *model.buffers()] if id(t) not in projections))


def held_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds, in whatever forms, each storage once."""
    counted = _Bytes()
    experts = sum(p.nbytes for p in expert_plans(model, counted))
    return experts + other_weight_bytes(model, counted) + sum(p.nbytes for p in projection_plans(model, counted))


def report(model: nn.Module, quantization: str = "none") -> str:
    mib = 1 << 20
    weights = "as loaded" if quantization == "none" else f"quantized at load ({quantization})"
    lines = [f"model: {model.describe()}, {next(model.parameters()).dtype} weights {weights}"]
    lines += [f"  {kind} step: {words}" for kind, words in step_plans(model).items()]
    lines += choice_lines(getattr(model, "choices", None))
    lines.append("projections:")
    counted = _Bytes()
    experts = expert_plans(model, counted)
    others = other_weight_bytes(model, counted)  # before the projections: a tied head's weight is the embedding
    projections = projection_plans(model, counted)
    for p in projections + experts:
        lines.append(f"  {p.kind:8} x{p.count:<3} {p.kernel}  [{p.nbytes / mib:.1f} MiB]")
    total = sum(p.nbytes for p in projections + experts) + others
    lines.append(f"other weights (embedding, norms, routers): {others / mib:.1f} MiB")
    for name, module in model.named_children():  # token tables read from the GGUF (gguf_embeddings)
        if hasattr(module, "file_bytes"):
            lines.append(f"  {name}: the GGUF's {module.type_name} rows, read per lookup from the file's map "
                         f"[{module.file_bytes / mib:.1f} MiB in the file, not held]")
    lines.append(f"weights held in all: {total / mib:.1f} MiB")
    return "\n".join(lines)
