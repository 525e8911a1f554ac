"""A GGUF of an LFM2 checkpoint as llama.cpp's converter writes one (`convert_hf_to_gguf.py`:
`LFM2Model`), for tests/test_gguf_lfm2.py. Checked by hand against the converter of llama-cpp-python
0.3.36 (`--outtype f32` and `q8_0`) on the tiny LFM2 of tests/test_hybrid.py: the same keys and
values (but the tokenizer's, copied here from the default model's file), the same tensors, names,
types and bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.qwen35_gguf import _copy_tokenizer, add_attention_metadata, finish


def write_lfm2_gguf(model_dir: Path, out: Path, tokenizer_gguf: Path, q8_0: bool = False) -> Path:
    """`model_dir` (float32 safetensors of an `lfm2` model) as the converter's GGUF at `out`."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), "lfm2")
    writer.add_name("lfm2")
    # the converter writes the KV heads per layer, 0 on a short-conv layer
    kv_heads = [cfg["num_key_value_heads"] if t == "full_attention" else 0 for t in cfg["layer_types"]]
    add_attention_metadata(writer, {**cfg, "num_key_value_heads": kv_heads, "rms_norm_eps": cfg["norm_eps"]})
    # the MLP's width as built (block_auto_adjust_ff_dim), not the config's intermediate_size
    writer.add_feed_forward_length(int(checkpoint["model.layers.0.feed_forward.w1.weight"].shape[0]))
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_shortconv_l_cache(cfg["conv_L_cache"])
    _copy_tokenizer(writer, tokenizer_gguf)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, layers)
    tensors = {}
    for name, t in checkpoint.items():
        data = t.float().numpy()
        if name.endswith("conv.conv.weight"):
            data = data.squeeze(1)  # [D, 1, L] -> [D, L]
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(name)
        tensors[gguf_name] = np.ascontiguousarray(data)
    finish(writer, tensors, q8_0)
    return out
