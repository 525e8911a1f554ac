"""Hybrid families (Gated DeltaNet state layers beside gated attention: Qwen3-Next, Qwen3.5 text and
Qwen3.5-MoE; LFM2's short-conv state layers beside GQA attention) against transformers.

The layer: Baton's Gated DeltaNet, given transformers' layer's weights, computes its output over a
sequence fed in pieces (two prefill chunks, then decode tokens, each continuing from the state
slot) as transformers computes it over the whole sequence at once. The model: a tiny random-init
model of each family (a few layers of both kinds, the MoE with its gated shared expert for
Qwen3-Next), built like tests/test_families.py builds its families, gives transformers' greedy
tokens in float32 through `LLM.generate`: batched, in prefill chunks whose edges fall inside and
across blocks, and preempted and recomputed (its state slot rebuilt from scratch).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams
from tests.test_families import (SMALL, built_once, greedy, hf_greedy, prompts,  # noqa: F401 (prompts: a fixture)
                                 assert_bf16_near_ties_only, save_with_tokenizer, tokens_of)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                linear_conv_kernel_dim=4)
# a state layer first (the runner must not take layer 0 for an attention layer), one attention layer
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
GRANITE = dict(layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=8, mamba_n_groups=2,
               mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, shared_intermediate_size=128,
               embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)
HYBRIDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # MoE on layers 0, 2, 3 (4 experts, top 2, renormalised) with the gated shared expert; layer 1 dense
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict()),
    # every layer MoE (4 experts, top 2, always renormalised) with the gated shared expert
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    # short-conv state layers (no Gated DeltaNet keys); the MLP's width derived by the block_* keys: 128 -> 96
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        layer_types=["conv", "conv", "full_attention", "conv"], rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 10000.0},
        conv_L_cache=3, block_multiple_of=32)),
    # Granite 4.0-H: Mamba-2 state layers (2 groups of 4 heads, 16-token scan chunks: prompts span
    # several) beside rotary attention, Granite's multipliers off 1, every MLP the dense shared one
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        **GRANITE, num_local_experts=0, position_embedding_type="rope")),
    # the MoE form (4 experts, top 2, beside the shared MLP), attention without rotary (the config
    # class's default); its config.json says model_type granitemoehybrid like the dense one
    "granitemoehybrid_moe": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        **GRANITE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
}
# the vision-language checkpoints served text only: (text family, config class, model class)
VISION_LANGUAGE = {"qwen3_5": ("qwen3_5_text", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
                   "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")}


# Qwen3.5's vision-language checkpoint (`qwen3_5`), served text only: the qwen3_5_text model above
# under `model.language_model.*`, a vision tower as small as its config class allows under `model.visual.*`
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                   temporal_patch_size=2, spatial_merge_size=2)


def build_hybrid(family: str, out: Path, tokenizer_dir: Path, layer_types: list[str] | None = None) -> Path:
    """`layer_types`: a Gated DeltaNet family's, LAYER_TYPES by default."""
    import transformers

    text_family = VISION_LANGUAGE[family][0] if family in VISION_LANGUAGE else family
    config_name, model_name, overrides = HYBRIDS[text_family]
    own_layers = text_family == "lfm2" or text_family.startswith("granite")  # their overrides name the layer kinds
    deltanet = {} if own_layers else {**DELTANET, "layer_types": layer_types or LAYER_TYPES, "rope_parameters": ROPE}
    text = {**SMALL, "num_hidden_layers": 4, **deltanet, **overrides}
    if text_family == "qwen3_5_moe_text":
        del text["intermediate_size"]  # as released: no dense MLP, no dense size
    if family in VISION_LANGUAGE:
        _, vl_config_name, model_name = VISION_LANGUAGE[family]
        config = getattr(transformers, vl_config_name)(text_config=text, vision_config=TINY_VISION)
    else:
        config = getattr(transformers, config_name)(**text)
    torch.manual_seed(sum(map(ord, family)))
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and not name.endswith("embed_tokens.weight"):
                param.mul_(5.0)  # far from near-uniform logits (as tests/test_families.py does)
            elif name.endswith("norm.weight"):
                # norms off their init (a norm loaded wrong changes the output); the final one
                # large, stored as (w - 1): top logits far apart
                param.add_(0.2 * torch.randn_like(param))
                if name in ("model.norm.weight", "model.language_model.norm.weight", "model.embedding_norm.weight"):
                    param.add_(29.0)
    return save_with_tokenizer(model, out, tokenizer_dir)


_DIRS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, default_model_dir):
    return built_once(build_hybrid, _DIRS, tmp_path_factory, default_model_dir)


# ------------------------------------------------------------------ the layer, fed in pieces

def random_layer(layer_class: Any, config: Any, seed: int) -> Any:
    """transformers' layer 0 of `layer_class`, its parameters drawn N(0, 0.3) (off their init, so a
    weight read wrong shows), in eval mode."""
    torch.manual_seed(seed)
    layer = layer_class(config, 0).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    return layer


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])  # the two layouts (Qwen3.5-MoE's is Qwen3.5's)
def test_gated_deltanet_in_pieces_equals_transformers_whole(family):
    import transformers

    from baton.model.gated_deltanet import DeltaNetDims, GatedDeltaNet, StateMeta, StatePool

    config_name, _, _ = HYBRIDS[family]
    config = getattr(transformers, config_name)(hidden_size=64, num_hidden_layers=1,
                                                layer_types=["linear_attention"], **DELTANET)
    if family == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as Reference
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as Reference
    reference = random_layer(Reference, config, seed=7)
    dims = DeltaNetDims(2, 4, 16, 8, 4, "grouped" if family == "qwen3_next" else "split")
    layer = GatedDeltaNet(dims, 64, config.rms_norm_eps, state_index=0)
    layer.load_state_dict(reference.state_dict(), strict=True)  # the checkpoint's names, as is
    x = torch.randn(2, 90, 64)
    none = torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        expected = reference(x)  # [2, 90, 64], each sequence whole, from a zero state
        pool = StatePool(dims, 1, 4, torch.float32, torch.device("cpu"))
        a, b = pool.slot("a", starting=True), pool.slot("b", starting=True)
        # both sequences in one step: a's first 37 tokens, b's first 5 (shorter than the conv kernel's state)
        first = layer(torch.cat([x[0, :37], x[1, :5]]), pool, StateMeta(none, [(0, 37, a), (37, 5, b)]))
        second = layer(torch.cat([x[0, 37:88], x[1, 5:90]]), pool, StateMeta(none, [(0, 51, a), (51, 85, b)]))
        decode = [layer(x[0, t:t + 1], pool, StateMeta(torch.tensor([a]), [])) for t in (88, 89)]
    got_a = torch.cat([first[:37], second[:51], *decode])
    got_b = torch.cat([first[37:], second[51:]])
    assert expected.abs().max() > 1.0  # not a vanishing output
    torch.testing.assert_close(got_a, expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, expected[1], atol=1e-4, rtol=1e-4)
    # a slot taken again from the start is zeroed: the same output as a fresh one
    with torch.no_grad():
        again = layer(x[0, :37], pool, StateMeta(none, [(0, 37, pool.slot("a", starting=True))]))
    torch.testing.assert_close(again, expected[0, :37], atol=1e-4, rtol=1e-4)


def test_short_conv_in_pieces_equals_transformers_whole():
    """LFM2's gated short convolution, fed in pieces from its state slot (prefill chunks shorter and
    longer than its conv state, then decode tokens), computes what transformers' layer computes
    over each whole sequence."""
    import transformers
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    from baton.model.gated_deltanet import StateMeta, StatePool
    from baton.model.short_conv import ShortConv, ShortConvDims

    config = transformers.Lfm2Config(hidden_size=64, num_hidden_layers=1, layer_types=["conv"], conv_L_cache=3)
    reference = random_layer(Lfm2ShortConv, config, seed=11)
    dims = ShortConvDims(64, 3, bias=False)
    layer = ShortConv(dims, state_index=0)
    layer.load_state_dict(reference.state_dict(), strict=True)  # the checkpoint's names under `conv.`
    x = torch.randn(2, 20, 64)
    none = torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        expected = reference(x)
        pool = StatePool(dims, 1, 4, torch.float32, torch.device("cpu"))
        assert pool.recurrent is None  # a conv state only
        a, b = pool.slot("a", starting=True), pool.slot("b", starting=True)
        first = layer(torch.cat([x[0, :7], x[1, :1]]), pool, StateMeta(none, [(0, 7, a), (7, 1, b)]))
        second = layer(torch.cat([x[0, 7:18], x[1, 1:20]]), pool, StateMeta(none, [(0, 11, a), (11, 19, b)]))
        decode = [layer(x[0, t:t + 1], pool, StateMeta(torch.tensor([a]), [])) for t in (18, 19)]
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(torch.cat([first[:7], second[:11], *decode]), expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([first[7:], second[11:]]), expected[1], atol=1e-4, rtol=1e-4)


def test_mamba2_in_pieces_equals_transformers_whole():
    """Granite 4.0-H's Mamba-2 mixer, fed in pieces from its state slot (prefill chunks shorter than
    its conv state and longer than a scan chunk, then decode tokens through the recurrent update),
    computes what transformers' layer computes over each whole sequence (its chunked SSD scan)."""
    import transformers
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    from baton.model.gated_deltanet import StateMeta, StatePool
    from baton.model.mamba2 import Mamba2Dims, Mamba2Mixer

    config = transformers.GraniteMoeHybridConfig(hidden_size=64, num_hidden_layers=1, layer_types=["mamba"],
                                                 mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
                                                 mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)
    reference = random_layer(GraniteMoeHybridMambaLayer, config, seed=3)
    dims = Mamba2Dims(hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16, conv_kernel=4,
                      chunk_size=16, conv_bias=True, proj_bias=False, eps=config.rms_norm_eps)
    layer = Mamba2Mixer(dims, state_index=0)
    layer.load_state_dict(reference.state_dict(), strict=True)  # the checkpoint's names under `mamba.`
    x = torch.randn(2, 90, 64)
    none = torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        expected = reference(x)
        pool = StatePool(dims, 1, 4, torch.float32, torch.device("cpu"))
        assert pool.recurrent is not None and pool.recurrent.shape[2:] == (8, 16, 16)  # the SSM state, fp32
        a, b = pool.slot("a", starting=True), pool.slot("b", starting=True)
        first = layer(torch.cat([x[0, :37], x[1, :2]]), pool, StateMeta(none, [(0, 37, a), (37, 2, b)]))
        second = layer(torch.cat([x[0, 37:88], x[1, 2:90]]), pool, StateMeta(none, [(0, 51, a), (51, 88, b)]))
        decode = [layer(x[0, t:t + 1], pool, StateMeta(torch.tensor([a]), [])) for t in (88, 89)]
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(torch.cat([first[:37], second[:51], *decode]), expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([first[37:], second[51:]]), expected[1], atol=1e-4, rtol=1e-4)
    # a slot taken again from the start is zeroed: the same output as a fresh one
    with torch.no_grad():
        again = layer(x[0, :37], pool, StateMeta(none, [(0, 37, pool.slot("a", starting=True))]))
    torch.testing.assert_close(again, expected[0, :37], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ greedy parity, float32

@pytest.mark.parametrize("family", list(HYBRIDS))
def test_greedy_matches_transformers(family, hybrid_dir, prompts):  # noqa: F811
    model_dir = hybrid_dir(family)
    expected = [hf_greedy(model_dir, p) for p in prompts]
    assert len({t for r in expected for t in r}) >= 8  # not one repeated token: the model is fit for parity
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128)
    runner = llm.engine.runtime.runner
    assert runner.kv_cache.shape[0] == 1 and runner.state_pool is not None  # KV for the one attention layer
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    assert len(runner.state_pool.owner) == 0  # every finished request gave its slot back
    # chunked prefill: 8 tokens a step (edges inside 16-token blocks), decode mixed with other chunks;
    # then 6 a step over 4-token blocks (edges inside and on block edges)
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=6)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    # preempted and recomputed: 4-token blocks, 21 in all (the 70-token request alone needs 20);
    # without the prefix cache from the first token, with it from the last state snapshot it reached
    for caching in (False, True):
        llm = LLM(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=21,
                  enable_prefix_caching=caching)
        assert tokens_of(llm.generate(prompts, greedy())) == expected
        assert llm.engine.scheduler.num_preemptions > 0
        assert len(llm.engine.runtime.runner.state_pool.owner) == 0
        assert (llm.engine.state_cache is not None and llm.engine.state_cache.num_resumed > 0) is caching


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "granitemoehybrid"])  # the three kinds of state layer
def test_a_shared_prefix_resumes_from_a_state_snapshot(family, hybrid_dir, prompts):  # noqa: F811
    """Prefix caching with state: a prompt's state at its last full block is kept, and so is the
    last full block a request reached while decoding. A second request with the same prompt and
    more resumes from the first (cached tokens: every full block of the prompt), a chat's next
    turn (the prompt, the answer, a new message) from the answer's last full block; both give
    transformers' tokens, as they do with the cache off."""
    model_dir = hybrid_dir(family)
    prompt = prompts[3]  # 70 tokens: 17 full 4-token blocks, the state kept at token 68
    llm = LLM(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=32)
    first = llm.generate([prompt], greedy())[0]
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == hf_greedy(model_dir, prompt)
    longer = prompt + prompts[1]
    again = llm.generate([longer], greedy())[0]
    assert again.num_cached_tokens == 68
    assert again.outputs[0].token_ids == hf_greedy(model_dir, longer)
    # the next turn: the 70-token prompt and its 8 answer tokens were computed but the last (77
    # tokens): the decode passed block boundaries 72 and 76, and the request kept the state at 76
    turn = prompt + first.outputs[0].token_ids + prompts[0]
    nxt = llm.generate([turn], greedy())[0]
    assert nxt.num_cached_tokens == 76
    assert nxt.outputs[0].token_ids == hf_greedy(model_dir, turn)
    cache = llm.engine.state_cache
    assert cache is not None and cache.num_resumed == 2
    assert len(llm.engine.runtime.runner.state_pool.owner) == 0
    # a prefix whose KV blocks are cached but whose state was never kept resumes nothing: block 8
    # (tokens 32-35) ended no chunk of the first prompt (chunks of 32: 0-32, 32-64, 64-68)
    mid = prompt[:36] + prompts[2]
    assert llm.generate([mid], greedy())[0].num_cached_tokens == 32


@pytest.mark.parametrize("family", list(VISION_LANGUAGE))
def test_the_vision_language_checkpoint_is_served_text_only(family, hybrid_dir, prompts, caplog):  # noqa: F811
    """Qwen3.5 and Qwen3.5-MoE as released (`Qwen3_5ForConditionalGeneration`, model_type qwen3_5;
    `Qwen3_5MoeForConditionalGeneration`, qwen3_5_moe): Baton serves the language model, the vision
    tower skipped by name (logged), and gives the greedy tokens of transformers' whole model given
    text only."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    model_dir = hybrid_dir(family)
    reference = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        expected.append(out[0, len(prompt):].tolist())
    assert len({t for r in expected for t in r}) >= 8
    with caplog.at_level("INFO", logger="baton.model.loader"):
        llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8)
    assert "skipping the vision tower" in caplog.text
    assert llm.engine.model_config.text_only_of == family
    assert tokens_of(llm.generate(prompts, greedy())) == expected


def test_multi_token_prediction_tensors_are_skipped_by_name(hybrid_dir, prompts, tmp_path, caplog):  # noqa: F811
    """Released Qwen3-Next / Qwen3.5 checkpoints carry their MTP module as `mtp.*` beside the model;
    Baton does not run it: skipped and counted in the log, the tokens unchanged; any other unknown
    tensor is still refused by name."""
    from safetensors.torch import load_file, save_file

    model_dir = hybrid_dir("qwen3_5_text")
    with_mtp = tmp_path / "mtp"
    shutil.copytree(model_dir, with_mtp)
    tensors = load_file(with_mtp / "model.safetensors")
    tensors.update({"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.zeros(64)})
    save_file(tensors, with_mtp / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="baton.model.loader"):
        llm = LLM(model=str(with_mtp), dtype="float32", num_kv_blocks=128)
    assert "skipping the multi-token-prediction layers: 2 tensors" in caplog.text
    assert tokens_of(llm.generate(prompts, greedy())) == [hf_greedy(model_dir, p) for p in prompts]
    tensors["model.layers.0.linear_attn.extra.weight"] = torch.zeros(4)
    save_file(tensors, with_mtp / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not use: layers\.0\.linear_attn\.extra\.weight"):
        LLM(model=str(with_mtp), dtype="float32", num_kv_blocks=16)


# Qwen3-Next's tiny MoE model is left out: there transformers' own bf16 misses its float32 argmax
# by 4.5% of the logit spread on the 17-token prompt's first token (a routing flip), so the
# criterion would judge bf16 itself, not Baton
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "lfm2", "granitemoehybrid"])
def test_bf16_greedy_is_transformers_but_at_near_ties(family, hybrid_dir, prompts):  # noqa: F811
    """The serving dtype (as tests/test_families.py checks every family): each of 16 greedy bf16
    tokens is transformers' float32 argmax after the same tokens, or within 3% of the row's logit
    spread of it; most are exact."""
    from tests.test_families import hf_model

    model_dir = hybrid_dir(family)
    hf = hf_model(model_dir)
    llm = LLM(model=str(model_dir), dtype="bfloat16", num_kv_blocks=128, max_num_batched_tokens=16)
    assert_bf16_near_ties_only(llm, hf, prompts, family)
    from baton.model.gated_deltanet import GatedDeltaNet

    for layer in llm.engine.runtime.model.layers:  # b and a ran as one fp32 matmul (`join_gates`)
        if isinstance(layer.linear_attn, GatedDeltaNet):
            gates = layer.linear_attn.gates
            assert gates is not None and gates.dtype == torch.float32
            x = torch.randn(3, gates.shape[1]).to(torch.bfloat16)
            separate = torch.cat([layer.linear_attn.in_proj_b(x), layer.linear_attn.in_proj_a(x)], dim=-1).float()
            joined = torch.nn.functional.linear(x.float(), gates).to(torch.bfloat16).float()
            assert (joined - separate).abs().max() <= 2 ** -7 * separate.abs().max()


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "fp8")])
def test_a_hybrid_step_leaves_no_flush_to_zero_behind(dtype, kv_cache_dtype, hybrid_dir, prompts):  # noqa: F811
    """The state layers run with denormals flushed (their decays make them, and x86 computes on them
    5x slower), and the mode is cleared after each: fp8 KV codes and MXFP4 scales convert through
    denormal floats, which the mode would read as zero. After a hybrid's steps, on this thread and
    on its pool's (a product split across them), denormals are computed and an fp8 subnormal code
    reads as its value. With an fp8 KV cache the mode covers each state layer only, not the step: its
    attention layers convert fp8 codes."""
    llm = LLM(model=str(hybrid_dir("qwen3_5_text")), dtype=dtype, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runtime.model.flush_per_layer == (kv_cache_dtype == "fp8")
    llm.generate(prompts[:2], greedy())
    tiny = torch.full((1 << 20,), 1e-30) * 1e-10  # 1e-40: a denormal
    assert bool((tiny != 0).all())
    code = torch.tensor([1], dtype=torch.uint8).view(torch.float8_e4m3fn)  # e4m3's smallest subnormal
    assert code.float().item() == 2.0 ** -9


def test_state_slots_take_at_most_half_the_kv_budget(hybrid_dir, prompts, caplog):  # noqa: F811
    """A state slot per running request is large beside a token's KV (Qwen3.5-0.8B: 19 MiB, ~1500
    tokens' KV): max_num_seqs slots once took a 1 GiB pool whole and left the KV one block. The
    slots get at most half the budget (max_num_seqs lowered, said in the log), the KV the rest, and
    requests beyond the slots wait their turn."""
    model_dir = hybrid_dir("qwen3_5_text")
    probe = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=8, max_num_seqs=1)
    per_slot = probe.engine.runtime.state_bytes(1)
    budget = 8 * per_slot  # room for 4 slots in half of it
    with caplog.at_level("WARNING", logger="baton.engine.llm_engine"):
        llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=budget, max_num_seqs=64,
                  enable_prefix_caching=False)
    engine = llm.engine
    assert engine.scheduler.config.max_num_seqs == 4
    assert "at most 4 requests run at once (--max-num-seqs 64 lowered" in caplog.text
    block = engine.runtime.block_bytes(16)  # the KV has the other half (block 0 is the pool's reserved one)
    assert engine.kv_cache_bytes <= budget and engine.pool.num_usable_blocks == budget // 2 // block - 1
    expected = [hf_greedy(model_dir, p) for p in prompts]
    assert tokens_of(llm.generate(prompts * 2, greedy())) == expected * 2  # 8 requests through 4 slots


def test_bf16_runs_and_the_state_slots_come_out_of_the_kv_budget(hybrid_dir, prompts):  # noqa: F811
    model_dir = hybrid_dir("qwen3_5_text")
    llm = LLM(model=str(model_dir), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=16)
    assert "state layers" in llm.engine.runtime.model.describe()
    assert "3 state layers, 1 attention layers" in llm.engine.runtime.plan_report()  # `baton plan`
    outputs = tokens_of(llm.generate(prompts, greedy()))
    assert all(len(t) == 8 for t in outputs)
    # the state slots (one per --max-num-seqs request) come out of the KV memory budget; a block
    # holds the one attention layer's K and V only
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8)
    runtime, engine = llm.engine.runtime, llm.engine
    slot_bytes = 3 * (2 * 32 + 32) * 3 * 4 + 3 * 4 * 16 * 8 * 4  # 3 layers: conv [2*32+32, 3] + [4, 16, 8] fp32
    assert runtime.state_bytes(8) == 8 * slot_bytes and runtime.runner.state_pool.conv.shape[1] == 8
    assert runtime.block_bytes(16) == 1 * 2 * 16 * 2 * 16 * 4
    # and the prefix cache's state snapshots: a quarter of what the slots leave, at most 4 per request
    assert engine.state_cache is not None and engine.state_cache.capacity == 32
    assert engine.pool.num_blocks == ((4 << 20) - (8 + 32) * slot_bytes) // runtime.block_bytes(16)


# ------------------------------------------------------------------ baton serve: prefill and decode workers

def test_baton_serve_gives_transformers_greedy_tokens(hybrid_dir, prompts):  # noqa: F811
    """The whole system on Qwen3.5 (gateway, a prefill and a decode worker, Redis): the prefill
    worker hands over the prompt's KV blocks and the state at the end of the prompt; the decode
    worker loads both instead of recomputing the prompt (every prompt's full blocks fetched: a
    missing or foreign state would have it fetch none and recompute), and the tokens are
    transformers'; the deployment ends idle."""
    from tests.test_serve_families import assert_served_as_transformers

    # 16-token blocks (the default): the longer prompts have full blocks (the streamed chat's may add some)
    full_blocks = sum(len(p) // 16 for p in prompts)
    assert full_blocks > 0
    assert_served_as_transformers(hybrid_dir("qwen3_5_text"), prompts, min_blocks_fetched=full_blocks)


def test_a_decode_worker_killed_mid_stream_then_a_follow_up_turn(hybrid_dir):  # noqa: F811
    """Qwen3.5 across processes (a prefill and two decode workers): 6 greedy streams, one decode
    worker kill -9'd mid-stream; every stream ends with exactly the tokens of the engine alone (the
    survivor resumes each orphan from the store: the prompt's blocks and its state, then the tokens
    already sent). Then a chat's next turn (a prompt, its answer and a new message, as token ids)
    hits the prefill worker's state snapshot at the prompt's last full block: cached_tokens > 0,
    the same tokens."""
    import httpx

    from tests.cluster import Cluster
    from tests.test_faults import WORDS, expected_ids, run_streams_and_kill

    model_dir = hybrid_dir("qwen3_5_text")
    reference = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(6)]  # 20-odd tokens: a full 16-token block each
    with Cluster(model_dir, prefill=1, decode=2) as cluster:
        got = run_streams_and_kill(cluster, texts, 40, "decode-0", after_tokens=60)
        assert cluster.procs["decode-0"].poll() is not None
        assert got == expected_ids(reference, texts, 40)
        ids = httpx.post(cluster.base_url + "/tokenize", json={"prompt": texts[0]}).json()["tokens"]
        turn = ids + got[0][:-1] + ids[:5]  # the answer (its end marker dropped), then a new message
        r = httpx.post(cluster.base_url + "/v1/completions", timeout=60, json={
            "prompt": turn, "max_tokens": 8, "temperature": 0, "logprobs": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) // 16 * 16 > 0
        want = reference.generate([turn], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
        assert body["choices"][0]["text"] == want


# ------------------------------------------------------------------ configs as released

def test_released_configs_resolve_as_transformers_reads_them(tmp_path):
    """Config files shaped as the released ones (Qwen3-Next-80B-A3B, and a Qwen3.5 vision-language
    checkpoint), with what they leave to their config classes' defaults: the layer kinds
    (`full_attention_interval`), the Gated DeltaNet sizes, the partial rotary and the untied head
    come out as transformers' config classes make them."""
    from transformers import AutoConfig

    from baton.model.config import ModelConfig

    next_raw = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936,
                "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
                "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10,
                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
                "norm_topk_prob": True, "full_attention_interval": 4, "rope_theta": 10000000,
                "max_position_embeddings": 262144, "rms_norm_eps": 1e-6}
    vl_raw = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024,
                              "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8,
                              "num_key_value_heads": 2, "head_dim": 256, "linear_num_value_heads": 16,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                                  "mrope_section": [11, 11, 10], "mrope_interleaved": True,
                                                  "partial_rotary_factor": 0.25}},
              "vision_config": {"model_type": "qwen3_5", "depth": 2}}
    for name, raw in (("next", next_raw), ("vl", vl_raw)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        hf = AutoConfig.from_pretrained(tmp_path / name)
        text = getattr(hf, "text_config", hf)
        config = ModelConfig.from_dir(tmp_path / name)
        assert config.layer_deltanet == [t == "linear_attention" for t in text.layer_types]
        assert config.attention_layers == [i for i, t in enumerate(text.layer_types) if t == "full_attention"]
        assert config.deltanet == dict(num_k_heads=text.linear_num_key_heads, num_v_heads=text.linear_num_value_heads,
                                       head_k_dim=text.linear_key_head_dim, head_v_dim=text.linear_value_head_dim,
                                       conv_kernel=text.linear_conv_kernel_dim,
                                       layout="grouped" if name == "next" else "split")
        assert config.partial_rotary_factor == text.rope_parameters["partial_rotary_factor"] == 0.25
        assert config.tie_word_embeddings is False and config.norm_kind == "gemma"
    assert ModelConfig.from_dir(tmp_path / "vl").text_only_of == "qwen3_5"
    next_config = ModelConfig.from_dir(tmp_path / "next")
    assert (next_config.num_experts, next_config.shared_expert_intermediate_size) == (512, 512)
    assert all(next_config.is_moe(i) for i in range(48)) and len(next_config.attention_layers) == 12


def test_released_lfm2_and_qwen3_5_moe_configs_resolve_as_transformers_reads_them(tmp_path):
    """LFM2-1.2B's config as released (the older keys: `block_ff_dim`, `full_attn_idxs`, no
    `layer_types`, head tied by default) and a Qwen3.5-MoE vision-language config (no dense
    `intermediate_size`): the layer kinds, the MLP width, the eps and the head come out as
    transformers' classes make them."""
    from transformers import AutoConfig
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    from baton.model.config import ModelConfig

    lfm2 = {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "vocab_size": 65536, "hidden_size": 2048,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "block_ff_dim": 12288,
            "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
            "full_attn_idxs": [2, 5, 8, 10, 12, 14], "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5,
            "rope_theta": 1000000.0, "max_position_embeddings": 128000}
    moe_vl = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "text_config": {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
                              "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                              "head_dim": 256, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                              "num_experts": 256, "num_experts_per_tok": 8},
              "vision_config": {"model_type": "qwen3_5_moe", "depth": 2}}
    for name, raw in (("lfm2", lfm2), ("moe", moe_vl)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
    hf = AutoConfig.from_pretrained(tmp_path / "lfm2")
    config = ModelConfig.from_dir(tmp_path / "lfm2")
    assert config.layer_deltanet == [t == "conv" for t in hf.layer_types] and config.attention_layers == [2, 5, 8, 10,
                                                                                                          12, 14]
    assert config.intermediate_size == Lfm2MLP(hf).w1.out_features == 8192
    assert config.rms_norm_eps == hf.norm_eps and config.tie_word_embeddings is hf.tie_word_embeddings is True
    assert config.deltanet == dict(hidden_size=2048, conv_kernel=3, bias=False, layout="short_conv")
    moe = ModelConfig.from_dir(tmp_path / "moe")
    text = AutoConfig.from_pretrained(tmp_path / "moe").text_config
    assert moe.text_only_of == "qwen3_5_moe" and moe.model_type == "qwen3_5_moe_text"
    assert moe.layer_deltanet == [t == "linear_attention" for t in text.layer_types]
    assert (moe.num_experts, moe.moe_intermediate_size, moe.shared_expert_intermediate_size) == (256, 512, 512)
    assert all(moe.is_moe(i) for i in range(40)) and moe.norm_topk_prob


def test_released_granite_4_h_config_resolves_as_transformers_reads_it(tmp_path):
    """A Granite 4.0-H MoE config shaped as released (the legacy `mamba` / `attention` layer names,
    no rotary, `mamba_d_head` given, the infinite time-step limit as transformers 5 writes it):
    the layer kinds, the Mamba-2 sizes, the multipliers and the MLP sizes come out as
    transformers' GraniteMoeHybridConfig makes them."""
    from transformers import AutoConfig

    from baton.model.config import ModelConfig
    from baton.model.mamba2 import Mamba2Dims
    from baton.model.short_conv import state_dims

    kinds = ["mamba"] * 5 + ["attention"] + ["mamba"] * 3 + ["attention"]
    raw = {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 100352,
           "hidden_size": 1536, "intermediate_size": 512, "shared_intermediate_size": 1024, "num_hidden_layers": 10,
           "num_attention_heads": 12, "num_key_value_heads": 4, "layer_types": kinds, "mamba_n_heads": 48,
           "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
           "mamba_chunk_size": 256, "num_local_experts": 64, "num_experts_per_tok": 6,
           "position_embedding_type": "nope", "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
           "attention_multiplier": 0.0078125, "logits_scaling": 6.0, "rms_norm_eps": 1e-5,
           "time_step_limit": [0.0, {"__float__": "Infinity"}], "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoConfig.from_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    assert config.layer_deltanet == [t == "linear_attention" for t in hf.layer_types]
    assert config.attention_layers == [5, 9]
    dims = state_dims(config.deltanet)
    assert isinstance(dims, Mamba2Dims)
    assert (dims.num_heads, dims.head_dim, dims.state_size, dims.n_groups, dims.conv_kernel, dims.chunk_size) == (
        hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups, hf.mamba_d_conv, hf.mamba_chunk_size)
    assert (dims.dt_min, dims.dt_max) == tuple(hf.time_step_limit) == (0.0, float("inf"))
    assert dims.conv_dim == 48 * 64 + 2 * 128 and dims.recurrent_shape == (48, 64, 128)
    assert not any(config.uses_rope(i) for i in range(10))  # position_embedding_type is not "rope"
    assert (config.embedding_multiplier, config.residual_multiplier, config.attention_scale, config.logits_scaling) == (
        hf.embedding_multiplier, hf.residual_multiplier, hf.attention_multiplier, hf.logits_scaling)
    assert (config.intermediate_size, config.moe_intermediate_size) == (hf.shared_intermediate_size,
                                                                          hf.intermediate_size)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (64, 6, True)
    assert config.rms_norm_eps == hf.rms_norm_eps and config.tie_word_embeddings is True
