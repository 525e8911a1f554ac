"""A Qwen3.5 checkpoint written as llama.cpp's converter writes it (`convert_hf_to_gguf.py`, its
`Qwen3_5TextModel`), for the tests: the converter is not a package the suite can install.

Its five departures from the checkpoint, each undone on load by transformers' conversion mapping
(`baton.model.gguf_mapped`): ggml names (`blk.N.attn_qkv`, `ssm_out`, ...); every RMSNorm weight but
the gated one stored as `w + 1`; `A_log` stored as `-exp(A_log)` under `ssm_a`, `dt_bias` as
`ssm_dt.bias`; the conv kernel squeezed to 2-D; the linear-attention value heads tiled ([k0 v0, k1 v0,
k0 v1, ...]) instead of grouped by key head, on every tensor with a value-head axis (out_proj's
columns). Checked tensor for tensor against the converter's output (llama-cpp-python 0.3.36's
vendored llama.cpp, `--outtype f32 --no-mtp`) on a tiny model with 2 key and 4 value heads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

NORM_LEAVES = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")


def _tiled(t: torch.Tensor, dim: int, k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    """Grouped by key head -> tiled, along `dim` (llama.cpp's `_reorder_v_heads`)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, per_k, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _converted(name: str, t: torch.Tensor, cfg: dict) -> tuple[str, torch.Tensor]:
    """(GGUF name, tensor) for one checkpoint tensor (`model.` stripped)."""
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    per_k, v_dim = v_heads // k_heads, cfg["linear_value_head_dim"]
    qk_rows = 2 * cfg["linear_key_head_dim"] * k_heads
    if name == "embed_tokens.weight":
        return "token_embd.weight", t
    if name == "lm_head.weight":
        return "output.weight", t
    if name == "norm.weight":
        return "output_norm.weight", t + 1
    _, i, rest = name.split(".", 2)
    blk = f"blk.{i}."
    module, _, leaf = rest.rpartition(".")
    part = module.rpartition(".")[2] if module else leaf
    if part in NORM_LEAVES:
        gguf = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}[part]
        return f"{blk}{gguf}.weight", t + 1
    if module == "linear_attn":  # A_log, dt_bias: one value per value head
        t = _tiled(t, 0, k_heads, per_k, 1)
        return (f"{blk}ssm_a", -torch.exp(t)) if leaf == "A_log" else (f"{blk}ssm_dt.bias", t)
    simple = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "linear_attn.norm": "ssm_norm"}
    if module in simple:
        return f"{blk}{simple[module]}.{leaf}", t
    if module == "linear_attn.in_proj_qkv":
        return f"{blk}attn_qkv.weight", torch.cat([t[:qk_rows], _tiled(t[qk_rows:], 0, k_heads, per_k, v_dim)])
    if module == "linear_attn.conv1d":
        t = t.squeeze(1)
        return f"{blk}ssm_conv1d.weight", torch.cat([t[:qk_rows], _tiled(t[qk_rows:], 0, k_heads, per_k, v_dim)])
    if module == "linear_attn.in_proj_z":
        return f"{blk}attn_gate.weight", _tiled(t, 0, k_heads, per_k, v_dim)
    if module in ("linear_attn.in_proj_a", "linear_attn.in_proj_b"):
        return f"{blk}ssm_{'alpha' if module.endswith('_a') else 'beta'}.weight", _tiled(t, 0, k_heads, per_k, 1)
    if module == "linear_attn.out_proj":
        return f"{blk}ssm_out.weight", _tiled(t, 1, k_heads, per_k, v_dim)
    moe = {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
           "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
           "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    if module in moe:
        return f"{blk}{moe[module]}.{leaf}", t
    raise KeyError(name)


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A MoE checkpoint's experts (`mlp.experts.E.gate_proj.weight`, ...) stacked per layer and
    projection into [E, out, in], as the converter writes them (`ffn_gate_exps`, ...)."""
    stacked: dict[str, list[tuple[int, torch.Tensor]]] = {}
    rest = {}
    for name, t in tensors.items():
        parts = name.removeprefix("model.").split(".")
        if len(parts) == 7 and parts[2:4] == ["mlp", "experts"]:
            leaf = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[parts[5]]
            stacked.setdefault(f"blk.{parts[1]}.{leaf}.weight", []).append((int(parts[4]), t))
        else:
            rest[name] = t
    experts = {name: torch.stack([t for _, t in sorted(ts, key=lambda e: e[0])]) for name, ts in stacked.items()}
    return {**rest, **experts}


def write_qwen35_gguf(model_dir: Path, out: Path, tokenizer_gguf: Path, q8_0: bool = False) -> Path:
    """`model_dir` (a Qwen3_5ForCausalLM checkpoint, float32) as a GGUF at `out`: float32 tensors, or
    with `q8_0` every 2-D weight whose rows are a multiple of 32 wide as Q8_0 (llama-quantize's rule
    for this type, the embedding included); its tokenizer copied from `tokenizer_gguf` (the default
    model's file: the tiny models share its vocabulary)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = _stacked_experts(load_file(str(model_dir / "model.safetensors")))
    arch = "qwen35moe" if "num_experts" in cfg else "qwen35"
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("Qwen3.5 tiny")
    if arch == "qwen35moe":
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    else:
        writer.add_feed_forward_length(cfg["intermediate_size"])
    add_attention_metadata(writer, cfg)
    rope = cfg["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(cfg["head_dim"] * rope["partial_rotary_factor"]))
    writer.add_rope_dimension_sections(rope.get("mrope_section", [11, 11, 10]) + [0])
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    writer.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer(writer, tokenizer_gguf)
    converted = dict((name, t.float()) if name.startswith("blk.") else _converted(name.removeprefix("model."),
                                                                                  t.float(), cfg)
                     for name, t in tensors.items())
    finish(writer, {name: value.contiguous().numpy() for name, value in converted.items()}, q8_0)
    return out


def finish(writer, tensors: dict[str, np.ndarray], q8_0: bool,
           keep_f32: Callable[[str], bool] = lambda name: False) -> None:
    """`tensors` added (float32, or with `q8_0` every 2-D weight whose rows are a multiple of 32 wide
    as Q8_0, but those `keep_f32` names) and the file written."""
    import gguf

    for gguf_name, data in tensors.items():
        if q8_0 and data.ndim >= 2 and data.shape[-1] % 32 == 0 and not keep_f32(gguf_name):
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_attention_metadata(writer, cfg: dict) -> None:
    """The sizes every architecture's header carries: layers, context, width, heads (and their width, where
    the config names it), norm epsilon."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def _copy_tokenizer(writer, source: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(source))
    fields = reader.fields
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"].contents())
    if "tokenizer.ggml.pre" in fields:
        writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    if "tokenizer.ggml.merges" in fields:
        writer.add_token_merges(fields["tokenizer.ggml.merges"].contents())
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id), ("padding_token_id", writer.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in fields:
            add(fields[f"tokenizer.ggml.{key}"].contents())
    if "tokenizer.chat_template" in fields:
        writer.add_chat_template(fields["tokenizer.chat_template"].contents())
