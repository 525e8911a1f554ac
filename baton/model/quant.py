"""What the projections' weights load as, and their quantization at load.

`resolve_weights` is where --dtype and --quantization become what loads: the dtype, and the
quantization to ask `quantize_model` for (`--dtype auto` with quantized weights on the CPU: bf16
wherever the native kernel runs, `auto_dtype`; `--dtype float32` with auto: a GGUF's dequantized
weights). `describe_weights` is the start-up line naming what runs.

`quantize_model(model, quantization, gguf_source=...)`, after `prepare()`, replaces each dense
projection's op (q|k|v, o, gate|up, down, and the LM head; a MoE's routed experts: one Q8_0 op per
expert and projection, `baton.model.moe_quant`, under int8 and int4 alike) by a
`baton.model.linear.QuantizedLinear` and frees the weight it replaced, so each weight lives once in
memory, quantized:
- "int8": GGUF's Q8_0 form (blocks of 32 along the input, one scale each: w = d * q);
- "int4": Q4_1's form (w = d * q + m, q in 0..15), the LM head in Q8_0 (its logits are what
  sampling reads);
- "auto" (the default): a model converted from a GGUF is served in the GGUF's own blocks, repacked
  as they are (`baton.model.gguf_weights`), any other model as it is; "none" keeps the model's dtype
  (a GGUF then runs dequantized, in --dtype).
The native kernel (`kernels/qgemv.cpp`: integer dot products, AVX512-VNNI or AVX2, against activations
quantized per block, as llama.cpp multiplies them) multiplies the packed blocks; afterwards the
all-layers decode call (`LayersPlan`) is rebuilt over them. The token embedding stays in the model's
dtype (a lookup reads one row per token; tied to the head, the head's quantized copy is the only other),
but for a GGUF's under "auto": its tables are read per lookup from the file's rows
(baton.model.gguf_embeddings).

Where the kernel cannot run (neither AVX512-VNNI nor AVX2, native kernels off: `native_kernels`, or no
compiler), `QuantizedLinear` dequantizes its weight for each call and multiplies in the activations'
dtype: correct, and slow; `quantize_model` says so in the log once. "auto" then serves a GGUF's
dequantized weights instead. The quantized weight is the same either way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from baton.model.layers_plan import LayersPlan
from baton.model.linear import QuantizedLinear
from baton.model.loader import UnreadWeights
from baton.model.model import set_op
from baton.model.moe_quant import quantize_dense_experts
from baton.model.q_blocks import quantize_q4, quantize_q8_0

logger = logging.getLogger("baton.model.quant")

QUANTIZATIONS = ("auto", "none", "int8", "int4")


def asks_for_quantized(quantization: str, gguf_source: Path | None) -> bool:
    """Whether `quantization` asks for quantized projections: int8 / int4, or auto on a GGUF's model."""
    return quantization != "none" and (quantization != "auto" or gguf_source is not None)


def auto_dtype(quantization: str, gguf_source: Path | None, device: torch.device, kernels: Any = None,
               native_kernels: bool = True) -> str:
    """What `--dtype auto` loads as when the weights are served quantized on the CPU: bfloat16, on
    every CPU the native kernel runs on. The quantized matmuls take bf16 activations as they take
    fp32 ones, and the bf16 path runs the rest of the layer natively (fused norms, the paged decode
    kernel, the all-layers decode call), where fp32 is the torch parity path. Measured on an AVX2
    AMD EPYC (Zen 3, no bf16 instructions, 2 threads), the default model's Q4_1 blocks: 64 decode
    tokens at batch 1 in 733 ms (bf16) against 1470 ms (fp32), a 512-token prefill 1164 against
    1151 ms. Otherwise "auto" (`baton.model.loader.resolve_dtype`: bf16 only with bf16 instructions).
    `native_kernels` False (RuntimeConfig.native_kernels): no native kernel is built or asked."""
    if not asks_for_quantized(quantization, gguf_source) or device.type != "cpu":
        return "auto"
    if kernels is None and native_kernels:
        from baton.model import kernels as native

        kernels = native.load()
    return "bfloat16" if kernels is not None and kernels.q8_available() else "auto"


def resolve_weights(dtype: str, quantization: str, gguf_source: Path | None, device: torch.device,
                    kernels: Any = None, native_kernels: bool = True) -> tuple[str, str]:
    """The one decision of what the weights load as, from --dtype and --quantization: (the dtype to
    load, the quantization to ask `quantize_model` for).

    `--dtype float32` asks for float32 numbers, transformers' (the parity tests' dtype, the container
    check's), so with `--quantization auto` a model converted from a GGUF is served from its
    dequantized weights ("none"): the file's own blocks multiply activations quantized per block of
    32, which leaves transformers' greedy tokens at near ties. An explicit int8 / int4 still quantizes;
    any other dtype (auto included) keeps the GGUF's blocks. `--dtype auto`: `auto_dtype`'s choice."""
    if dtype == "float32" and quantization == "auto" and gguf_source is not None:
        return dtype, "none"
    resolved = auto_dtype(quantization, gguf_source, device, kernels, native_kernels) if dtype == "auto" else dtype
    return resolved, quantization


def describe_weights(scheme: str, dtype: torch.dtype, requested_dtype: str, quantization: str,
                     gguf_source: Path | None) -> str:
    """The start-up line naming the weights that run: `scheme` is what `quantize_model` returned."""
    name = str(dtype).removeprefix("torch.")
    if scheme == "gguf":
        assert gguf_source is not None
        return (f"weights: the quantized blocks of {gguf_source.name}, as the file ships them (--quantization auto), "
                f"activations in {name}; --dtype float32 or --quantization none serves its dequantized weights")
    if scheme in ("int8", "int4"):
        blocks = "Q8_0" if scheme == "int8" else "Q4_1"
        return f"weights: {scheme} ({blocks} blocks of 32), quantized at load; activations in {name}"
    if gguf_source is None:
        return f"weights: {name}"
    if quantization == "none":
        why = "--quantization none"
    elif requested_dtype == "float32":
        why = "--dtype float32 asks for float32 numbers; --dtype auto or bfloat16 serves the file's own blocks"
    else:
        why = "no native kernel multiplies its blocks here: a CPU without AVX512-VNNI or AVX2, or another device"
    return f"weights: {name}, dequantized from {gguf_source.name} ({why})"


def serves_gguf_blocks(quantization: str, gguf_source: Path | None, device: torch.device,
                       native_kernels: bool) -> bool:
    """Whether `quantize_model` will serve the GGUF's own blocks (so the loader need not read the
    projections they replace): auto, a GGUF, the CPU and its native int8/4-bit kernel."""
    if quantization != "auto" or gguf_source is None or device.type != "cpu" or not native_kernels:
        return False
    from baton.model import kernels as native

    kernels = native.load()
    return kernels is not None and kernels.q8_available()


def quantize_model(model: nn.Module, quantization: str, kernels: Any = None,
                   gguf_source: Path | None = None, native_kernels: bool = True, build_plan: bool = True,
                   unread: UnreadWeights | None = None) -> str:
    """Quantize `model`'s projections in place (after `prepare()`) and return the scheme that now
    serves them: "none", "int8", "int4" or "gguf" (auto with `gguf_source`, the GGUF file the model
    directory was converted from). `kernels`: the native module (None: `baton.model.kernels.load()`,
    unless `native_kernels` is False: RuntimeConfig.native_kernels, then none). `unread`: the
    projections the loader left unread for the GGUF's blocks (`serves_gguf_blocks`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
    if not asks_for_quantized(quantization, gguf_source):
        return "none"
    if model.norm.weight.device.type != "cpu":  # (the embedding may be left unread: gguf_embeddings)
        if quantization == "auto":
            return "none"  # the kernels are CPU ones: a GGUF on another device runs dequantized
        raise ValueError(f"--quantization {quantization} runs on the CPU only")
    if kernels is None and native_kernels:
        from baton.model import kernels as native

        kernels = native.load()
    if quantization == "auto":
        # the GGUF's own blocks where the native kernel multiplies them; without it (no AVX512-VNNI/AVX2)
        # they would be dequantized per call, slower than the dequantized weights served as they are
        if kernels is None or not kernels.q8_available():
            logger.warning("%s: no native int8/4-bit kernel on this machine (AVX512-VNNI or AVX2): serving its "
                           "dequantized weights in the model's dtype", gguf_source.name)
            return "none"
        quantization = "gguf"
    if kernels is None or not kernels.q8_available():
        logger.warning("quantized weights without the native kernel (it needs AVX512-VNNI or AVX2 and a compiler): "
                       "each projection dequantizes its weight per call, which is slow")
    if quantization == "gguf":
        assert gguf_source is not None
        from baton.model.gguf_embeddings import load_gguf_embeddings
        from baton.model.gguf_experts import load_gguf_experts
        from baton.model.gguf_weights import GGUFTensors, load_gguf_projections

        try:
            source = GGUFTensors.of(model, gguf_source)
            load_gguf_projections(model, source, kernels, unread)
            load_gguf_experts(model, source, kernels, unread)
            load_gguf_embeddings(model, source, model.norm.weight.dtype)
        except ValueError as exc:
            raise ValueError(f"{gguf_source.name}: its blocks cannot be served as they are ({exc}); "
                             "--quantization none serves its dequantized weights") from exc
    else:
        _quantize_projections(model, quantization, kernels)
    # the all-layers native decode call, rebuilt over the quantized packs (None where it cannot run them;
    # prepare may have built none: bf16 projections without a pack, as on a CPU without AVX-512);
    # build_plan=False: the caller builds it once it has made its last change to the ops (load_runtime)
    model.layers_plan = LayersPlan.build(model, kernels) if build_plan and model.path == "native" else None
    return quantization


def _quantize_projections(model: nn.Module, quantization: str, kernels: Any) -> None:
    # MoE experts in Q8_0 (int4 too: 8 bits, as the head), unless MXFP4 experts were repacked at load
    quantize_dense_experts(model, kernels)
    for owner, name, linear in model.projection_slots():
        # int4 keeps the LM head in int8, as llama.cpp's 4-bit files keep `output` in 6-8 bits: the
        # logits are what sampling reads, and 4 bits there cost most of int4's perplexity (measured)
        if quantization == "int8" or linear is model.lm_head:
            op = QuantizedLinear.q8_0(*quantize_q8_0(linear.weight), linear.bias, kernels)
        else:
            op = QuantizedLinear.q4(*quantize_q4(linear.weight), linear.bias, kernels)
        set_op(owner, name, op)
        model.drop_projection_weight(linear)  # the only copy now is the quantized one

