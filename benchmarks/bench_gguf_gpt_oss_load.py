"""Load a gpt-oss-20b-shaped GGUF (random weights, MXFP4 experts) and print the load's time, peak
RSS and RSS once loaded (docs/benchmarks.md, "A gpt-oss GGUF").

The file is written once (tests/gpt_oss_gguf.py's layout, as llama.cpp's converter writes gpt-oss):
hidden 2880, 64 query / 8 KV heads of 64, 32 experts 2880 wide (top-4), YaRN, `--layers` of the 24
layers, the default model's vocabulary, Q8_0 outside the experts (ggml-org's gpt-oss-20b file: 12.1 GB
for 20.9B parameters, its 1.8B outside the experts in 8 bits; `--dense bf16` or `f32` instead). The load
runs in a fresh process.

    .venv/bin/python benchmarks/bench_gguf_gpt_oss_load.py --layers 4
    BATON_PACKED_CACHE=off .venv/bin/python benchmarks/bench_gguf_gpt_oss_load.py   # the worker's own memory
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOAD = """
import os, resource, sys, time
started = time.time()
from baton import LLM, SamplingParams
llm = LLM(model=sys.argv[1], num_kv_blocks=64)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
print(llm.engine.runtime.description)
print(f"load {time.time() - started:.1f} s; peak RSS {peak:.0f} MB; RSS once loaded {rss:.0f} MB")
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4))
print("tokens", out[0].outputs[0].token_ids)
"""


def write(path: Path, layers: int, dense_type: str = "q8_0") -> None:
    import gguf
    import numpy as np
    import torch

    from baton.common.model_files import gguf_source, resolve_model
    from tests.gpt_oss_gguf import ggml_mxfp4
    from tests.qwen35_gguf import _copy_tokenizer

    hidden, width, experts, heads, kv_heads, head_dim, vocab = 2880, 2880, 32, 64, 8, 64, 49152
    rng = np.random.default_rng(0)

    def dense(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    def mxfp4(rows: int, cols: int) -> np.ndarray:
        blocks = torch.from_numpy(rng.integers(0, 256, (experts, rows, cols // 32, 16), dtype=np.uint8))
        scales = torch.from_numpy(rng.integers(118, 123, (experts, rows, cols // 32), dtype=np.uint8))
        return ggml_mxfp4(blocks, scales)

    def add(name: str, value: np.ndarray) -> None:
        if dense_type == "f32" or value.ndim < 2:  # (norms, biases and sinks stay F32, as the converter keeps 1-D tensors)
            w.add_tensor(name, value)
        else:
            kind = gguf.GGMLQuantizationType.Q8_0 if dense_type == "q8_0" else gguf.GGMLQuantizationType.BF16
            w.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)

    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_name("gpt-oss-20b-shaped")
    w.add_block_count(layers)
    w.add_context_length(131072)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(width)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(experts)
    w.add_expert_used_count(4)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_sliding_window(128)
    w.add_expert_feed_forward_length(width)
    _copy_tokenizer(w, gguf_source(resolve_model(None)))
    add("token_embd.weight", dense(vocab, hidden))
    add("output.weight", dense(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for layer in range(layers):
        b = f"blk.{layer}."
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "post_attention_norm.weight", np.ones(hidden, np.float32))
        for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
            add(b + name + ".weight", dense(rows, hidden))
            w.add_tensor(b + name + ".bias", dense(rows))
        add(b + "attn_output.weight", dense(hidden, heads * head_dim))
        w.add_tensor(b + "attn_output.bias", dense(hidden))
        w.add_tensor(b + "attn_sinks.weight", dense(heads))
        add(b + "ffn_gate_inp.weight", dense(experts, hidden))
        w.add_tensor(b + "ffn_gate_inp.bias", dense(experts))
        for name in ("ffn_gate_exps", "ffn_up_exps"):
            w.add_tensor(b + name + ".weight", mxfp4(width, hidden), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            w.add_tensor(b + name + ".bias", dense(experts, width))
        w.add_tensor(b + "ffn_down_exps.weight", mxfp4(hidden, width), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        w.add_tensor(b + "ffn_down_exps.bias", dense(experts, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--file", type=Path, default=None, help="where the GGUF is (written if missing)")
    parser.add_argument("--dense", choices=("q8_0", "bf16", "f32"), default="q8_0", help="outside the experts")
    args = parser.parse_args()
    path = args.file or Path("/tmp") / f"gpt-oss-20b-shaped-{args.layers}l-{args.dense}.gguf"
    if not path.exists():
        sys.path.insert(0, str(ROOT))
        write(path, args.layers, args.dense)
    print(f"{path}: {path.stat().st_size / 1e6:.0f} MB")
    subprocess.run([sys.executable, "-c", LOAD, str(path)], check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
