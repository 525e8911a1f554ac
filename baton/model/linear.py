"""The matmul behind each projection, chosen once at load time.

bf16 on the CPU: `F.linear` hands oneDNN a plain row-major weight, which it reorders on every call
for small M; at M = 1 it streams weights at ~5-10 GB/s. Reordering the weight once into oneDNN's
blocked layout (`mkldnn._reorder_linear_weight`, what Inductor's weight freezing does) and calling
`mkldnn._linear_pointwise` is 1.5-2.5x faster at M = 1, 16 and 64 on every SmolLM2 shape (measured
on Sapphire Rapids, 1 thread: lm_head at M = 1 5.8 -> 2.3 ms; see docs/performance.md).

Every fast path has a fallback: the packed op is used only where oneDNN is built in, the weight is
bf16 on the CPU, and a probe multiplication equals `F.linear`'s; otherwise (float32 parity, CUDA,
builds without oneDNN) the plain `nn.Linear` is the op.

Few rows (a decode step at small batch) are a different problem: the matmul is a weight stream,
and oneDNN reads bf16 weights at a fraction of the machine's bandwidth there (10-15 of 32 GB/s on
Zen 4). `RowSplitLinear` adds the native kernel (`kernels/gemv.cpp`) for up to `max_native_rows`
rows, chosen per weight shape by timing both on this machine at load (`tune_row_split`): the
fastest per shape and row count, as the kernels differ by CPU.

Batch invariance (`BATON_BATCH_INVARIANT`: auto, the default, is on wherever the native kernel runs,
AMX or AVX512-BF16; full, matmul or off, see `batch_invariant_mode`): greedy tokens must not depend
on what else shares a step, or a request that a live decode worker resumes after a crash (in another
batch) produces other tokens than were already sent, and the gateway must fail it
(`resume_mismatch`). Choosing the kernel per row count breaks that: oneDNN and the native kernel
round differently, and oneDNN itself changes its kernel (and its reduction order) with M (measured
on an Intel Xeon with AMX: rows of an M = 40 call differ from the same rows alone). So in this mode every
bf16 projection runs the native kernel for every row count (`native_for_all_rows`), whose
per-row arithmetic does not depend on M (`kernels/gemv.cpp`: AMX where the CPU has it, else
AVX512-BF16), prefill and decode alike; no timing decides anything, so two workers on the same
kind of CPU compute the same numbers. This is vLLM's batch-invariant mode and SGLang's
deterministic inference, for this engine's CPU kernels (the costs: docs/performance.md). It also
keeps each weight once: the native pack is the only copy (the tuned split, `off`, keeps oneDNN's
pack beside it).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.model import runtime_env

logger = logging.getLogger("baton.model.linear")

LinearOp = Callable[[torch.Tensor], torch.Tensor]  # [..., in] -> [..., out]

PACK_BATCH_HINT = 64  # oneDNN picks its blocking for this M; measured flat across M = 1..64
ALL_ROWS = 1 << 40  # max_native_rows of a projection that takes the native kernel for every row count


BATCH_INVARIANT_MODES = ("full", "matmul", "off")
# what BATON_BATCH_INVARIANT (and RuntimeConfig.batch_invariant) may say
BATCH_INVARIANT_SPELLINGS = ("auto", "", "full", "matmul", "off", "1", "true", "yes", "on", "0", "false", "no")
_auto_said: set[str] = set()


def batch_invariant_mode(kernels: Any = None, requested: str | None = None) -> str:
    """`BATON_BATCH_INVARIANT`: "full" (also 1/true/yes/on): every projection computes a row the
    same whatever the row count, and prefill queries attend as decode steps do (see
    `PagedAttention.use_native_kernel`); "matmul": the projections only (prefill attention keeps
    SDPA, faster for long prompts, but a prompt's numbers then depend on how it was chunked);
    "off" (0/false/no): the fastest matmul kernel per row count, measured at load (two packs of each
    weight where the native kernel wins for few rows). "auto" (the default): "full" wherever the
    native matmul runs (`kernels`' choice: AMX, or AVX512-BF16 pair products), "off" where it cannot
    (no AVX512-BF16: oneDNN or F.linear is the only kernel), said once in the log. Without AMX the
    native kernel runs as fast as oneDNN's AVX512-BF16 kernel at every row count (1-512 rows, both
    on vdpbf16ps; docs/performance.md), so the invariant mode costs decode nothing there either."""
    if requested is None:  # a caller with no config of its own (the runtime reads it into RuntimeConfig)
        requested = runtime_env.batch_invariant() or "auto"
    raw = requested.strip().lower() or "auto"
    if raw in ("1", "true", "yes", "on", "full"):
        return "full"
    if raw in ("0", "false", "no", "off"):
        return "off"
    if raw == "matmul":
        return raw
    if raw != "auto":
        logger.warning("BATON_BATCH_INVARIANT=%r is none of auto, full, matmul, off: using auto", raw)
    if kernels is None:
        return "off"  # no native kernels (float32, another device, no compiler): nothing to choose
    kernel = kernels.gemv_kernel("") if hasattr(kernels, "gemv_kernel") else "none"
    mode = "full" if kernel in ("amx", "avx512bf16") else "off"
    if kernel not in _auto_said:
        _auto_said.add(kernel)
        if mode == "full":
            logger.info("greedy decode is batch-invariant (the native matmul, %s, runs every row count)", kernel)
        else:
            logger.info("greedy decode is not batch-invariant on this CPU (no native bf16 matmul: it needs "
                        "AVX512-BF16): a decode worker's takeover in bf16 may end a stream with resume_mismatch")
    return mode


class PackedLinear:
    """A bf16 projection with its weight prepacked for oneDNN (the original weight is not touched)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # weight: [out, in] bf16 on the CPU; bias: [out] or None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        self.bias = bias.detach() if bias is not None else None
        # the unpacked original (shared, not copied): for RowSplitLinear's pack; None once released
        self.weight: torch.Tensor | None = weight.detach()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_supported(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and _cpu_packs_bf16())


@functools.cache
def _cpu_packs_bf16() -> bool:
    """Whether oneDNN packs a bf16 weight on this CPU: torch has the op everywhere, but refuses it
    without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT (AMD Zen 2/3: "bf16 path needs the cpu support ...").
    Tried once on a tiny weight, so that a model's hundreds of projections do not each fail and warn."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PACK_BATCH_HINT)
        return True
    except RuntimeError as exc:
        logger.info("oneDNN cannot pack bf16 weights on this CPU (%s): bf16 projections run F.linear", exc)
        return False


def make_linear_op(linear: nn.Linear, fast: bool = True) -> LinearOp:
    """The fastest correct op for this projection: a PackedLinear where it is supported and its
    probe output equals F.linear's, else the module itself."""
    weight, bias = linear.weight, linear.bias
    if not fast or not packing_supported(weight):
        return linear
    try:
        op = PackedLinear(weight, bias)
        if not _agrees(op, lambda x: F.linear(x, weight, bias), weight.shape[1], weight.dtype):
            logger.warning("prepacked bf16 matmul disagrees with F.linear for %s: using F.linear",
                           tuple(weight.shape))
            return linear
        return op
    except (RuntimeError, AttributeError) as exc:  # a torch build without the op: plain F.linear
        logger.warning("prepacked bf16 matmul unavailable (%s): using F.linear", exc)
        return linear


class RowSplitLinear:
    """The native few-row kernel's pack of a bf16 weight, used for inputs of up to `max_native_rows`
    rows (0 until `tune_row_split` measured where it wins) and `large`, a PackedLinear, above. In
    the batch-invariant mode there is no `large`: the native kernel takes every row count and its
    pack is the weight's only copy (`native_for_all_rows`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Any,
                 large: PackedLinear | None = None) -> None:
        # weight: [out, in] bf16 on the CPU (not kept); bias: [out] or None
        self.large = large
        self.kernels = kernels
        self.packed = kernels.gemv_pack(weight.detach())  # [ceil(out/64), in/2, 64, 2]
        self.bias = bias.detach().float() if bias is not None else None
        self.out_features, self.in_features = weight.shape
        self.max_native_rows = 0 if large is not None else ALL_ROWS

    @classmethod
    def beside(cls, large: PackedLinear, kernels: Any) -> RowSplitLinear:
        """The native pack of `large`'s weight, with `large` for more rows than the split allows."""
        assert large.weight is not None, "RowSplitLinear needs the unpacked weight (before release_load_copies)"
        return cls(large.weight, large.bias, kernels, large=large)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] bf16 -> [..., out] bf16
        return self.kernels.gemv(x, self.packed, self.bias, self.out_features, False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` [T] -> [T, in] bf16, read from the native pack (a tied head's
        pack serves the embedding lookups, so the embedding need not be kept beside it)."""
        # pack [S, in/2, 64, 2]: row n is strip n // 64, lane n % 64, its elements in pairs
        return self.packed[ids // 64, :, ids % 64, :].reshape(ids.shape[0], self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if self.large is None or x.numel() <= self.max_native_rows * self.in_features:
            return self.native(x)
        return self.large(x)


def drop_load_copies(op: LinearOp) -> None:
    """Let go of the unpacked original a PackedLinear keeps for RowSplitLinear's pack (the
    nn.Linear's own tensor: `CausalLM.release_load_copies` frees it, or a tied embedding keeps it).
    Nothing else an op holds is a spare copy: the batch-invariant mode never makes a oneDNN pack, and
    the tuned split reads both of its packs."""
    large = op.large if isinstance(op, RowSplitLinear) else op if isinstance(op, PackedLinear) else None
    if large is not None:
        large.weight = None


TUNE_ROWS = (1, 2, 4, 8, 16)


def best_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _native_splits(ops: Sequence[LinearOp], kernels: Any) -> dict[tuple[int, int], list[tuple[int, RowSplitLinear]]]:
    """Per weight shape, the PackedLinears of `ops` the native kernel can run (even in_features),
    each with its index and wrapped in a RowSplitLinear beside its oneDNN pack, for the shapes where
    the native kernel agrees with oneDNN on a probe here (the others are logged)."""
    by_shape: dict[tuple[int, int], list[tuple[int, RowSplitLinear]]] = {}
    for i, op in enumerate(ops):
        if isinstance(op, PackedLinear) and op.in_features % 2 == 0:
            split = RowSplitLinear.beside(op, kernels)
            by_shape.setdefault((op.out_features, op.in_features), []).append((i, split))
    for shape, splits in list(by_shape.items()):
        first = splits[0][1]
        if not _agrees(first.native, first.large, shape[1], torch.bfloat16):  # type: ignore[arg-type]
            logger.warning("native bf16 matmul disagrees with oneDNN for %s: using oneDNN", shape)
            del by_shape[shape]
    return by_shape


def tune_row_split(ops: Sequence[LinearOp], kernels: Any) -> list[LinearOp]:
    """Wrap every PackedLinear of `ops` whose native few-row kernel is correct here, and set, per
    weight shape, the largest row count up to which the native kernel measured faster (each shape's
    ops timed together, all layers in turn, so the weights stream from memory as in a step).
    Returns the ops, wrapped where that pays; the others unchanged."""
    if not native_gemv(kernels):
        return list(ops)
    out: list[LinearOp] = list(ops)
    for (out_features, in_features), indexed in _native_splits(ops, kernels).items():
        split = [op for _, op in indexed]
        max_rows = 0
        with torch.inference_mode():
            for rows in TUNE_ROWS:
                x = torch.randn(rows, in_features).to(torch.bfloat16)
                native = best_seconds(lambda x=x: [op.native(x) for op in split])
                onednn = best_seconds(lambda x=x: [op.large(x) for op in split])
                if native >= onednn:
                    break
                max_rows = rows
        logger.info("matmul %dx%d: native kernel for up to %d rows, oneDNN above", out_features, in_features, max_rows)
        if max_rows:
            for i, op in indexed:
                op.max_native_rows = max_rows
                out[i] = op
    return out


def native_gemv(kernels: Any) -> bool:
    """Whether `kernels` has the native bf16 matmul on this CPU (AVX512-BF16, or AMX)."""
    return kernels is not None and hasattr(kernels, "gemv") and kernels.gemv_available()


def native_for_all_rows(linears: Sequence[nn.Linear], kernels: Any,
                        release: Callable[[nn.Linear], Any] | None = None) -> list[LinearOp]:
    """Batch-invariant mode: one op per projection that runs the native kernel for every row count
    (its per-row result does not depend on how many rows share the call), its pack the only copy
    the op holds: no oneDNN pack is made, so loading peaks at the checkpoint's weights plus this
    pack. A weight the native kernel cannot take (not bf16 on the CPU, odd in_features), or whose
    shape disagrees with F.linear on a probe here, gets `make_linear_op`'s op instead (and the
    output may then depend on the batch: logged). `release(linear)`, if given, frees a projection's
    own weight once its native pack is made (loading then peaks one weight above one copy)."""
    if not native_gemv(kernels):
        ops = [make_linear_op(linear) for linear in linears]
        if any(isinstance(op, PackedLinear) for op in ops):
            logger.warning("batch-invariant matmuls need the native kernel (AVX512-BF16): oneDNN runs, and "
                           "greedy tokens may depend on the batch")
        return ops
    out: list[LinearOp] = []
    agrees: dict[tuple[int, int], bool] = {}
    for linear in linears:
        weight, bias = linear.weight, linear.bias
        shape = (weight.shape[0], weight.shape[1])
        if not packing_supported(weight) or shape[1] % 2 != 0:
            out.append(make_linear_op(linear))
            continue
        op = RowSplitLinear(weight, bias, kernels)
        if shape not in agrees:
            agrees[shape] = _agrees(op.native, lambda x, w=weight, b=bias: F.linear(x, w, b), shape[1], torch.bfloat16)
            if not agrees[shape]:
                logger.warning("native bf16 matmul disagrees with F.linear for %s: using oneDNN (not batch-invariant)",
                               shape)
        if agrees[shape]:
            out.append(op)
            if release is not None:
                release(linear)
        else:
            out.append(make_linear_op(linear))
    kernel_name = kernels.gemv_kernel("") if hasattr(kernels, "gemv_kernel") else "native"
    logger.info("batch-invariant matmuls: the native kernel (%s) for every row count", kernel_name)
    return out


def _agrees(op: LinearOp, reference: LinearOp, in_features: int, dtype: torch.dtype) -> bool:
    """Whether a fast op's output on a fixed probe is within bf16 rounding of the reference's."""
    with torch.inference_mode():
        probe = torch.randn(3, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        expected = reference(probe).float()
        got = op(probe).float()
    return bool(torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()) + 1e-3))


# ---- quantized weights (int8 Q8_0; 4-bit Q4_0/Q4_1/Q4_K as d * q + m): made by baton.model.quant and
# baton.model.gguf_weights, multiplied by kernels/qgemv.cpp

Q8_BLOCK = 32  # weights per scale (GGUF's QK8_0, and the 4-bit formats' block)
_STRIP = 32  # outputs per strip of a native quantized pack (kernels/qgemv.cpp kQStrip)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [N, K] int8, d [N, K/32]) -> w [N, K] in `dtype`."""
    n, k = q.shape
    return (q.float().reshape(n, k // Q8_BLOCK, Q8_BLOCK) * d.float().unsqueeze(-1)).reshape(n, k).to(dtype)


def dequantize_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [N, K] uint8 in 0..15, d and m [N, K/32], stored as fp16) -> w = d * q + m [N, K] in `dtype`."""
    n, k = q.shape
    d16, m16 = d.to(torch.float16).float().unsqueeze(-1), m.to(torch.float16).float().unsqueeze(-1)
    return (q.float().reshape(n, k // Q8_BLOCK, Q8_BLOCK) * d16 + m16).reshape(n, k).to(dtype)


def column_runs(order: torch.Tensor) -> tuple[int, torch.Tensor]:
    """A permutation of columns as (run, order of runs): the longest run length (a power of two up to
    256) such that `order` moves whole aligned runs of that many consecutive columns; (1, order) if
    none does."""
    for run in (256, 128, 64, 32, 16, 8, 4, 2):
        if order.numel() % run:
            continue
        rows = order.view(-1, run)
        starts = rows[:, :1]
        if bool((starts % run == 0).all()) and torch.equal(rows - starts, torch.arange(run).expand_as(rows)):
            return run, (starts[:, 0] // run).contiguous()
    return 1, order


class QuantizedLinear:
    """[..., K] -> [..., N] through quantized weights: `scheme` "q8_0" (q int8, d) or "q4" (q uint8
    nibbles, d, m). The native kernel multiplies the packed bytes (the only copy); where it cannot
    run, the weight is dequantized for each call (correct, slow)."""

    SCHEMES = ("q8_0", "q4")

    # [K] int64 or None: the blocks' columns are the weight's in this order, so the input is read in
    # it (x[..., input_order]): a GGUF whose conversion reorders a weight's columns (Qwen3.5's
    # out_proj: value heads tiled) keeps its blocks as stored (`gguf_weights`)
    input_order: torch.Tensor | None = None
    # (input_order, run, order of its runs): the order as a permutation of runs of `run` consecutive
    # columns (Qwen3.5's are whole value heads), derived on first use (`_reordered`)
    _input_runs: tuple[torch.Tensor, int, torch.Tensor] | None = None
    # the pack is a view of the machine's one shared file (baton.model.packed_cache): another
    # worker's mapping of it is the same pages, so nothing more is shared of it
    shared: bool = False

    def __init__(self, scheme: str, parts: tuple[torch.Tensor, ...], bias: torch.Tensor | None, kernels: Any) -> None:
        if scheme not in self.SCHEMES:
            raise ValueError(f"unknown quantization scheme {scheme!r}")
        self.scheme = scheme
        self.out_features, self.in_features = parts[0].shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._kernels = kernels if kernels is not None and kernels.q8_available() else None
        if self._kernels is not None:
            pack = self._kernels.q8_pack if scheme == "q8_0" else self._kernels.q4_pack
            self.packed: torch.Tensor | None = pack(*parts)  # [ceil(N/32), K/32, bytes] u8: the only copy
            self.parts: tuple[torch.Tensor, ...] = ()
        else:
            self.packed = None
            self.parts = tuple(p.contiguous() for p in parts)

    @classmethod
    def from_packed(cls, scheme: str, packed: torch.Tensor, out_features: int, in_features: int,
                    bias: torch.Tensor | None, kernels: Any) -> QuantizedLinear:
        """An op over a pack the kernels made earlier (`q8_pack` / `q4_pack`), such as a read-only
        mapping of one file that every worker on the machine shares (baton.model.packed_cache):
        the kernels only read it, and nothing here copies it."""
        if kernels is None or not kernels.q8_available():
            raise ValueError("a packed weight needs the native kernels")
        if scheme not in cls.SCHEMES or packed.dtype != torch.uint8 or packed.dim() != 3:
            raise ValueError(f"not a {scheme} pack: {packed.dtype} {tuple(packed.shape)}")
        op = cls.__new__(cls)
        op.scheme, op.out_features, op.in_features = scheme, out_features, in_features
        op.bias = None if bias is None else bias.detach().float().contiguous()
        op._kernels, op.packed, op.parts = kernels, packed, ()
        op.shared = True
        return op

    def share_pack(self, packed: torch.Tensor) -> None:
        """Serve from `packed` (the same bytes, mapped from the machine's shared file) instead of
        this op's own pack, which is freed."""
        if self.packed is None or packed.shape != self.packed.shape or packed.dtype != self.packed.dtype:
            raise ValueError("the shared pack is not this op's pack")
        self.packed, self.shared = packed, True

    @classmethod
    def q8_0(cls, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None, kernels: Any) -> QuantizedLinear:
        return cls("q8_0", (q, d.float()), bias, kernels)

    @classmethod
    def q4(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None,
           kernels: Any) -> QuantizedLinear:
        return cls("q4", (q, d.to(torch.float16), m.to(torch.float16)), bias, kernels)

    @property
    def native(self) -> bool:
        return self._kernels is not None

    @property
    def isa(self) -> str:
        """The integer dot product the native kernel runs ("AVX512-VNNI", "AVX2"; "" without it)."""
        return self._kernels.qgemv_isa() if self._kernels is not None else ""

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weight in memory (scales included)."""
        if self.packed is not None:
            return self.packed.numel()
        return sum(p.numel() * p.element_size() for p in self.parts)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight's rows `ids` [T] -> [T, K] dequantized in `dtype`, as llama.cpp's get_rows
        reads a quantized token_embd: a tied head's blocks serve the embedding lookups too."""
        if self.packed is None:
            parts = [p[ids] for p in self.parts]
            return (dequantize_q8_0 if self.scheme == "q8_0" else dequantize_q4)(*parts, dtype=dtype)
        t, blocks = ids.shape[0], self.packed.shape[1]
        strips, lane = self.packed[ids // _STRIP], ids % _STRIP  # [T, blocks, bytes]
        at = torch.arange(t)
        if self.scheme == "q8_0":  # per block: q [8 groups][32 rows][4], then fp32 d [32], fp32 sums [32]
            q = strips[..., :1024].reshape(t, blocks, 8, _STRIP, 4).permute(0, 3, 1, 2, 4)[at, lane]
            d = strips[..., 1024:1152].contiguous().view(torch.float32).reshape(t, blocks, _STRIP)[at, :, lane]
            w = q.contiguous().view(torch.int8).float().reshape(t, blocks, Q8_BLOCK) * d.unsqueeze(-1)
        else:  # per block: nibbles [8 groups][16 lanes][4] (rows 0-15 low, 16-31 high), fp16 d [32], m [32]
            nibbles = strips[..., :512].reshape(t, blocks, 8, 16, 4).permute(0, 3, 1, 2, 4)[at, lane % 16]
            q = (nibbles >> (4 * (lane >= 16).to(torch.uint8)).view(t, 1, 1, 1)) & 15
            scales = strips[..., 512:640].contiguous().view(torch.float16).reshape(t, blocks, 2, _STRIP)
            d, m = scales[at, :, 0, lane].float(), scales[at, :, 1, lane].float()
            w = q.float().reshape(t, blocks, Q8_BLOCK) * d.unsqueeze(-1) + m.unsqueeze(-1)
        return w.reshape(t, self.in_features).to(dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The blocks [N, K] dequantized, in their stored column order (from the parts: only without
        the native pack); the weight is `[:, argsort(input_order)]` of it where an order is set."""
        if self.scheme == "q8_0":
            return dequantize_q8_0(*self.parts, dtype=dtype)
        return dequantize_q4(*self.parts, dtype=dtype)

    def _reordered(self, x: torch.Tensor) -> torch.Tensor:
        """x[..., input_order], gathered a run of columns at a time where the order moves whole runs:
        column by column, a [16, 2048] bf16 input took 75-140 us (Qwen3.5's out_proj, 18 calls a
        step); as 16 runs of 128 columns, ~6 us."""
        order = self.input_order
        assert order is not None
        if self._input_runs is None or self._input_runs[0] is not order:
            self._input_runs = (order, *column_runs(order))
        _, run, runs = self._input_runs
        if run == 1:
            return x.index_select(-1, runs)
        return x.reshape(*x.shape[:-1], -1, run).index_select(-2, runs).reshape(x.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = self._reordered(x)
        if self._kernels is not None:
            return self._kernels.qgemv(x, self.packed, self.bias, self.out_features, x.dtype == torch.float32)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), bias)
