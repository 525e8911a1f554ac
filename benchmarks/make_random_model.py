"""A random-init Llama of Llama-3.2-1B's shapes, for memory and speed figures at 1B scale.

Weights do not change speed or memory, so a seeded random-init checkpoint stands in for the real
one (which needs a Hub login): 16 layers, hidden 2048, MLP 8192, 32 heads, 8 KV heads, vocab
128256, tied embeddings, rope llama3. Saved in bf16 with `save_pretrained` beside the default
model's tokenizer (its ids are a subset of the vocabulary).

    python benchmarks/make_random_model.py /tmp/llama-1b-shapes
    python benchmarks/make_random_model.py --tiny /tmp/llama-tiny    # 2 layers, 6 MB: the engine's fixed part
    python benchmarks/bench_memory.py --model /tmp/llama-1b-shapes --schemes none,int8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true",
                        help="2 layers of hidden 64 and the default model's vocabulary: a worker's RSS with it is "
                             "what the engine holds besides the weights (kernels, tokenizer, KV pool)")
    args = parser.parse_args()

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
