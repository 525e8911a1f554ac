"""A gpt-oss GGUF read as the checkpoint OpenAI ships: its tensors under the safetensors names, the
MXFP4 experts as `*_blocks` + `*_scales` again, so the one loader path of gpt-oss serves both.

llama.cpp's converter (`conversion/gpt_oss.py`) departs from the checkpoint in four ways, each undone
here on access, one tensor (one layer's stack) at a time:
- ggml names (`blk.N.attn_sinks.weight` for `layers.N.self_attn.sinks`, `ffn_gate_inp` for the router);
- gate_up_proj, whose rows interleave gate and up (gate even), split into `ffn_gate_exps` and
  `ffn_up_exps` (its bias likewise): interleaved again;
- the MXFP4 blocks rewritten in ggml's layout: per 32 values one E8M0 scale byte, then 16 bytes whose
  byte j holds value j (low nibble) and value j + 16 (high), where the checkpoint keeps the scales
  apart and byte i holds values 2i (low) and 2i + 1 (high). The scale bytes are the same numbers;
- experts that are not MXFP4 (a requantized file) stored [experts, out, in]: the checkpoint's
  [experts, in, out] again.

Nothing is dequantized here: the blocks go to `baton.model.mxfp4_experts` (Q8_0 ops without loss) or
to its dequantization (`--quantization none`), as a safetensors checkpoint's would.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from baton.model.gguf_mapped import SourcedTensors

MXFP4_BLOCK_BYTES = 17  # one scale byte + 16 bytes of 32 FP4 codes
# the tensors outside the experts: ggml's name -> the checkpoint's (without `model.`)
TOP_LEVEL = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}
PER_LAYER = {"attn_norm.weight": "input_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
             "ffn_gate_inp.bias": "mlp.router.bias", "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
             **{f"attn_{ggml}.{kind}": f"self_attn.{hf}_proj.{kind}"
                for ggml, hf in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")}}


def checkpoint_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 bytes [..., rows, G * 17] -> the checkpoint's (blocks [..., rows, G, 16], scales
    [..., rows, G]), uint8."""
    raw = np.asarray(raw, dtype=np.uint8)
    grouped = raw.reshape(*raw.shape[:-1], raw.shape[-1] // MXFP4_BLOCK_BYTES, MXFP4_BLOCK_BYTES)
    scales, packed = grouped[..., 0], grouped[..., 1:]
    blocks = np.empty(packed.shape, dtype=np.uint8)
    for half, codes in ((slice(0, 8), packed & 0x0F), (slice(8, 16), packed >> 4)):  # values 0-15, 16-31
        # byte i: values 2i (low nibble) and 2i + 1 (high)
        np.bitwise_or(codes[..., 0::2], codes[..., 1::2] << 4, out=blocks[..., half])
    return torch.from_numpy(blocks), torch.from_numpy(np.ascontiguousarray(scales))


def _interleaved(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """gate and up alternating along `dim`, gate first (the checkpoint's gate_up order)."""
    out = torch.empty(*gate.shape[:dim], 2 * gate.shape[dim], *gate.shape[dim + 1:], dtype=gate.dtype)
    index = [slice(None)] * gate.dim()
    index[dim] = slice(0, None, 2)
    out[tuple(index)] = gate
    index[dim] = slice(1, None, 2)
    out[tuple(index)] = up
    return out


class GptOssGGUFTensors(SourcedTensors):
    """name (no `model.` prefix) -> tensor, read on access: float32, or uint8 for MXFP4 blocks/scales."""

    def __init__(self, reader: Any) -> None:
        self._by_ggml = {t.name: t for t in reader.tensors}
        self._sources: dict[str, tuple[str, ...]] = {}  # checkpoint name -> how to make it (__getitem__)
        self._made: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}  # (_blocks_of)
        for name in self._by_ggml:
            if name in TOP_LEVEL:
                self._sources[TOP_LEVEL[name]] = ("plain", name)
                continue
            if not name.startswith("blk."):
                self._sources[name] = ("plain", name)  # unknown: the strict loader names it
                continue
            _, block, leaf = name.split(".", 2)
            prefix = f"layers.{block}."
            if leaf in PER_LAYER:
                self._sources[prefix + PER_LAYER[leaf]] = ("plain", name)
            elif leaf == "ffn_gate_exps.bias":
                self._sources[prefix + "mlp.experts.gate_up_proj_bias"] = ("gate_up_bias", block)
            elif leaf == "ffn_gate_exps.weight":
                self._add_experts(prefix + "mlp.experts.gate_up_proj", "gate_up", block, name)
            elif leaf == "ffn_down_exps.weight":
                self._add_experts(prefix + "mlp.experts.down_proj", "down", block, name)
            elif leaf not in ("ffn_up_exps.weight", "ffn_up_exps.bias"):  # (read with their gate)
                self._sources[name] = ("plain", name)

    def _add_experts(self, stem: str, kind: str, block: str, ggml_name: str) -> None:
        if self._by_ggml[ggml_name].tensor_type.name == "MXFP4":
            self._sources[stem + "_blocks"] = (f"{kind}_blocks", block)
            self._sources[stem + "_scales"] = (f"{kind}_scales", block)
        else:
            self._sources[stem] = (f"{kind}_dense", block)

    def _dense(self, name: str) -> torch.Tensor:
        from gguf import dequantize

        tensor = self._by_ggml[name]
        return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True))

    def _blocks_of(self, kind: str, block: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, scales) of one stack; each is made with the other, so the first read keeps the other
        for the second (the loader reads a stack's blocks, then its scales) and nothing is done twice."""
        if (kind, block) in self._made:
            return self._made.pop((kind, block))
        pair = self._make_blocks(kind, block)
        self._made[(kind, block)] = pair
        return pair

    def _make_blocks(self, kind: str, block: str) -> tuple[torch.Tensor, torch.Tensor]:
        leaves = ("ffn_gate_exps", "ffn_up_exps") if kind == "gate_up" else ("ffn_down_exps",)
        parts = [checkpoint_blocks(self._by_ggml[f"blk.{block}.{leaf}.weight"].data) for leaf in leaves]
        if len(parts) == 1:
            return parts[0]
        (gate_b, gate_s), (up_b, up_s) = parts
        return _interleaved(gate_b, up_b, 1), _interleaved(gate_s, up_s, 1)  # rows: gate, up, gate, ...

    def __getitem__(self, name: str) -> torch.Tensor:
        how, arg = self._sources[name]
        if how == "plain":
            return self._dense(arg)
        if how == "gate_up_bias":  # [E, I] each -> [E, 2I]
            return _interleaved(self._dense(f"blk.{arg}.ffn_gate_exps.bias"),
                                self._dense(f"blk.{arg}.ffn_up_exps.bias"), 1)
        kind, _, form = how.rpartition("_")
        if form in ("blocks", "scales"):
            blocks, scales = self._blocks_of(kind, arg)
            return blocks if form == "blocks" else scales
        if kind == "gate_up":  # [E, I, H] each -> [E, H, 2I]
            return _interleaved(self._dense(f"blk.{arg}.ffn_gate_exps.weight"),
                                self._dense(f"blk.{arg}.ffn_up_exps.weight"), 1).transpose(1, 2).contiguous()
        return self._dense(f"blk.{arg}.ffn_down_exps.weight").transpose(1, 2).contiguous()  # [E, H, I] -> [E, I, H]

    def expert_slice(self, name: str, expert: int) -> torch.Tensor | None:
        return None  # gpt-oss's experts are never served from a GGUF's per-expert slices


def has_mxfp4(reader: Any) -> bool:
    return any(t.tensor_type.name == "MXFP4" for t in reader.tensors)
