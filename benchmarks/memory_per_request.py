"""Memory one request holds at a given context, as Baton allocates it, for models of released shapes.

Computed, not timed: each model's config.json (the released shapes, through transformers' config
classes and their defaults) is read by Baton's own `ModelConfig`, and the bytes are those its KV pool
and state pool take (`kv_bytes_per_block`, `StatePool.bytes_per_slot`): KV blocks for the tokens of
every attention layer, plus a hybrid's fixed state per request. For a model with sliding-window
layers beside global ones (Gemma 3) the window layers have block tables of their own
(baton.model.kv_groups, docs/design-decisions.md 21): it prints what one table for every layer would
hold, and what Baton holds (the global table every block, each window table at most the window and
two blocks: the one being written and the one the window's start falls in).

    python benchmarks/memory_per_request.py              # 8192 tokens, bf16
    python benchmarks/memory_per_request.py --tokens 32768
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16


def released_configs() -> dict[str, object]:
    from transformers import Gemma3TextConfig, GptOssConfig, LlamaConfig, Qwen3_5TextConfig

    return {
        # Llama-3.2-1B
        "Llama-3.2-1B (dense, 16 layers)": LlamaConfig(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072),
        # Qwen3.5-0.8B's text model: 18 Gated DeltaNet layers, 6 gated attention layers
        "Qwen3.5-0.8B (hybrid, 6 of 24 layers attention)": Qwen3_5TextConfig(
            vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
            num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_value_heads=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}),
        # Gemma-3-1B: 5 sliding (512-token window) layers to 1 global
        "Gemma-3-1B (26 layers, 512-token window on 5 of 6)": Gemma3TextConfig(
            hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144,
            max_position_embeddings=32768),
        # gpt-oss-20b: 128-token window and full attention alternating
        "gpt-oss-20b (24 layers, 128-token window on 12)": GptOssConfig(
            hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=32, num_experts_per_tok=4,
            vocab_size=201088),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from baton.model.config import ModelConfig
    from baton.model.gated_deltanet import StatePool
    from baton.model.kv_groups import kv_groups
    from baton.model.model_runner import kv_bytes_per_block
    from baton.model.short_conv import state_dims

    blocks = -(-args.tokens // BLOCK)
    print(f"memory per request at {args.tokens} tokens, bf16 weights and KV cache, {BLOCK}-token blocks "
          "(MiB = 2^20 bytes)")
    print("| model | KV, one block table | KV held by Baton | state | total held |")
    print("| --- | --- | --- | --- | --- |")
    for name, hf in released_configs().items():
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(hf.to_dict()))
            config = ModelConfig.from_dir(tmp)
        groups = kv_groups(config)
        per_block = kv_bytes_per_block(config, BLOCK, torch.bfloat16)  # one group of layers
        one_table = blocks * per_block * len(config.attention_layers) // groups.group_size
        held_blocks = blocks
        if groups.grouped:
            assert config.sliding_window is not None
            held_blocks += groups.num_window_tables * min(blocks, -(-(config.sliding_window + BLOCK) // BLOCK) + 1)
        kv = held_blocks * per_block
        state = (StatePool.bytes_per_slot(state_dims(config.deltanet), sum(config.layer_deltanet), torch.bfloat16)
                 if config.has_state_layers else 0)
        print(f"| {name} | {one_table / 2**20:.1f} MiB | {kv / 2**20:.1f} MiB | {state / 2**20:.1f} MiB | "
              f"{(kv + state) / 2**20:.1f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
