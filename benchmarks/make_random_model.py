"""A random-init Llama of Llama-3.2-1B's shapes, for memory and speed figures at 1B scale.

Weights do not change speed or memory, so a seeded random-init checkpoint stands in for the real
one (which needs a Hub login): 16 layers, hidden 2048, MLP 8192, 32 heads, 8 KV heads, vocab
128256, tied embeddings, rope llama3. Saved in bf16 with `save_pretrained` beside the default
model's tokenizer (its ids are a subset of the vocabulary).

    python benchmarks/make_random_model.py /tmp/llama-1b-shapes
    python benchmarks/make_random_model.py --tiny /tmp/llama-tiny    # 2 layers, 6 MB: the engine's fixed part
    python benchmarks/bench_memory.py --model /tmp/llama-1b-shapes --schemes none,int8

`--gguf q8_0` writes a GGUF instead (no llama.cpp needed): Llama-3.2-1B's layer shapes with the
default model's tokenizer and 49152-token vocabulary (its `tokenizer.*` fields copied), every
projection and the tied embedding as Q8_0 blocks of random int8 quants under one small fp16 scale,
norms 1.0: 1.07B parameters, 1.14 GB. With `--tiny`, the same writer's 2-layer model (5 MB, mostly
the tokenizer): bench_shared_weights.py's fixed cost of a worker.

    python benchmarks/make_random_model.py --gguf q8_0 /tmp/llama-1b-shapes.Q8_0.gguf
    python benchmarks/bench_shared_weights.py --model /tmp/llama-1b-shapes.Q8_0.gguf --workers 4

`--family qwen3_5`: Qwen3.5-0.8B's shapes (the hybrid: Gated DeltaNet and attention), bf16; llama.cpp's
converter makes its GGUF (`convert_hf_to_gguf.py DIR --outtype q8_0 --no-mtp`). `--family gemma3`:
Gemma-3-1B's shapes (window and global layers: the KV cache groups), bf16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

Q8_0_BLOCK = 32  # weights per Q8_0 block: an fp16 scale, then 32 int8 quants (34 bytes)


def q8_0_random_blocks(rng: np.random.Generator, rows: int, cols: int, scale: float = 0.002) -> np.ndarray:
    """Random Q8_0 blocks as the file stores them, [rows, cols / 32 * 34] bytes: the quants are drawn as int8
    directly (no floats to quantize), every block under the same fp16 `scale`, so weights are +-0.25 at most."""
    import numpy as np

    blocks = np.empty((rows, cols // Q8_0_BLOCK, 2 + Q8_0_BLOCK), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(-127, 128, size=(rows, cols // Q8_0_BLOCK, Q8_0_BLOCK), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_q8_0_gguf(out: Path, tiny: bool, seed: int) -> int:
    """Writes the GGUF and returns its parameter count; shapes are [rows, cols] as numpy sees them
    (GGUF lists them reversed)."""
    import gguf
    import numpy as np

    from baton.common.model_files import gguf_source, resolve_model

    layers, hidden, ffn, heads, kv_heads = (2, 64, 128, 4, 2) if tiny else (16, 2048, 8192, 32, 8)
    head_dim = hidden // heads
    reader = gguf.GGUFReader(str(gguf_source(resolve_model(None))))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("llama-tiny-random" if tiny else "llama-1b-shapes-random")
    writer.add_context_length(131072 if not tiny else 2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        extra = {"sub_type": field.types[-1]} if kind == gguf.GGUFValueType.ARRAY else {}
        writer.add_key_value(field.name, field.contents(), kind, **extra)
    rng = np.random.default_rng(seed)
    q8 = gguf.GGMLQuantizationType.Q8_0
    params = vocab * hidden + (2 * layers + 1) * hidden
    writer.add_tensor("token_embd.weight", q8_0_random_blocks(rng, vocab, hidden), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
                  "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
                  "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, (rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", q8_0_random_blocks(rng, rows, cols), raw_dtype=q8)
            params += rows * cols
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return params


def save_random_bf16(model_class: Any, config: Any, out: Path, seed: int) -> int:
    """A seeded random-init `model_class(config)` saved in bf16 beside the default model's tokenizer."""
    import torch
    from transformers import AutoTokenizer

    from baton.common.model_files import resolve_model

    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{out}: {params / 1e6:.1f}M parameters, {2 * params / 1e6:.1f} MB in bf16")
    return 0


def write_qwen3_5(out: Path, seed: int) -> int:
    """Qwen3.5-0.8B's text shapes (hidden 1024, 24 layers, MLP 3584; attention every 4th layer: 8 heads
    of 256, 2 KV heads, a quarter of each head rotary; Gated DeltaNet: 16 key and 16 value heads of 128,
    conv 4), tied embeddings, with the default model's tokenizer (49152 ids, not Qwen's 248k), bf16."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    return save_random_bf16(Qwen3_5ForCausalLM, config, out, seed)


def write_gemma3(out: Path, seed: int) -> int:
    """Gemma-3-1B's text shapes (hidden 1152, 26 layers, MLP 6912, 4 heads of 256, 1 KV head, a global
    layer every 6th and 512-token windows on the rest: the cache groups' model), tied embeddings, with
    the default model's tokenizer (49152 ids, not Gemma's 262k), bf16."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=49152, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
        query_pre_attn_scalar=256)
    return save_random_bf16(Gemma3ForCausalLM, config, out, seed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write the checkpoint to (with --gguf: the .gguf file)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true",
                        help="2 layers of hidden 64 and the default model's vocabulary: a worker's RSS with it is "
                             "what the engine holds besides the weights (kernels, tokenizer, KV pool)")
    parser.add_argument("--gguf", choices=["q8_0"], default=None,
                        help="write a GGUF of Q8_0 blocks (random quants) instead of a bf16 checkpoint")
    parser.add_argument("--family", choices=["llama", "qwen3_5", "gemma3"], default="llama",
                        help="qwen3_5: a Qwen3.5-0.8B-shaped hybrid (24 layers of hidden 1024, Gated DeltaNet "
                             "with an attention layer every 4th, the default model's 49152-token vocabulary), bf16; "
                             "its GGUF from llama.cpp's convert_hf_to_gguf.py; gemma3: Gemma-3-1B's shapes "
                             "(sliding-window and global layers), bf16")
    args = parser.parse_args()
    if args.family == "qwen3_5":
        return write_qwen3_5(args.out, args.seed)
    if args.family == "gemma3":
        return write_gemma3(args.out, args.seed)

    if args.gguf:
        params = write_q8_0_gguf(args.out, args.tiny, args.seed)
        print(f"{args.out}: {params / 1e6:.1f}M parameters, {args.out.stat().st_size / 1e6:.1f} MB as Q8_0")
        return 0

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from baton.common.model_files import resolve_model

    if args.tiny:
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    else:
        config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                             rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {params / 1e6:.1f}M parameters, {2 * params / 1e6:.1f} MB in bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
