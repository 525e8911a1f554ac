"""Every supported family, on a tiny random-init model, against transformers' greedy output.

Each family's model is built from its own transformers config class (a few layers, hidden 64,
seeded), weights scaled up so that greedy is decided by clear margins (see conftest's
`tiny_model_dir`), saved with `save_pretrained` next to the default model's tokenizer. Baton's
greedy tokens (float32, the parity path) must equal `generate(do_sample=False)`'s, batched, in
8-token prefill chunks, and through preemption and recompute; prompts are longer than every
sliding window (and every Llama 4 chunk). A vision-language checkpoint (mistral3, gemma3, llama4, gemma4) is
built whole, with a tiny vision tower, and Baton serves its text model: greedy tokens equal those of
transformers' model given text only (its language model and head). Also: a checkpoint with an unknown or a missing tensor is
refused by name, tensors skipped by a named rule (a vision tower, GLM's MTP layer, Gemma 4's
KV-shared layers' K/V weights) are counted in
the log, and each non-Llama family runs in bf16 on the torch path (the native kernels do the plain
Llama layer only).

Runtime: one model per family per session (module-scoped fixtures), one transformers model and
one greedy reference per prompt, and one torch thread (tiny matmuls gain nothing from more).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.window_blocks import freeable_window
from baton.model.config import ModelConfig
from baton.model.kv_groups import kv_groups

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 8
PROMPT_LENS = (3, 17, 40, 70)
VOCAB = 49152  # the default model's tokenizer
WINDOW = 24

SMALL: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1,
                             eos_token_id=2, pad_token_id=2, max_position_embeddings=512)


def _rotary_factors(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [round(1.0 + 3.0 * rng.random(), 3) for _ in range(n)]


# Ministral 3's rotary: YaRN, and queries scaled up past `original_max_position_embeddings` (32 here,
# so that the longer prompts cross it twice)
MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=32,
                       max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                       llama_4_scaling_beta=0.5)
GEMMA3_TEXT = dict(
    sliding_window=WINDOW, query_pre_attn_scalar=24, num_hidden_layers=4,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}})
# Llama 4: layers 0-2 rotary with chunked attention (16-token chunks, so that prompts cross several)
# and L2 q/k norm, layer 3 no rotary with temperature-tuned queries (floor_scale 8, so that they grow
# within the prompts); layers 1 and 3 MoE (4 experts, top-1, a shared expert), 0 and 2 dense and wider
CHUNK = 16
LLAMA4_TEXT = dict(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=1, intermediate_size=32,
                   intermediate_size_mlp=128, interleave_moe_layer_step=2, attention_chunk_size=CHUNK,
                   floor_scale=8, attn_scale=0.5)
# DeepSeek V3: MLA (q through a rank-48 q_a/q_b, a rank-32 latent KV and an 8-dim interleaved rotary
# key) and GLM-4.5's MoE: 8 experts in 4 groups, the best 2 eligible (V3's half: 4 of 8 groups), a
# shared expert, layer 0 dense (with 2 groups, 1 eligible, a near-tie between the two groups at one
# bf16 decode row flipped half the experts: a discontinuity of routing, not of MLA); YaRN with mscale_all_dim (the softmax scale grows with it) on a 64-token original context;
# head_dim is the rotary width (DeepseekV3Config sets it so; SMALL's 16 would survive a reload)
DEEPSEEK_V3 = dict(num_hidden_layers=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                   topk_group=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                   rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                        original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                        mscale=1.0, mscale_all_dim=0.707))
# Gemma 4: layers 0, 1, 3, 4 slide (head_dim 16, 2 KV heads), 2 and 5 are full (head_dim 32, one KV
# head, K = V, the proportional rotary on half of each half-head); layers 4 and 5 share the K/V of
# layers 3 and 2 (the last unshared layer of their type) with double-wide MLPs; per-layer inputs of 8
# per layer; final soft-capping
GEMMA4_TEXT = dict(
    num_hidden_layers=6, sliding_window=WINDOW, global_head_dim=32, num_global_key_value_heads=1,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                 "full_attention"],
    attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB, final_logit_softcapping=8.0,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                        "rope_theta": 1000000.0}})
# Gemma 4's MoE block (4 experts, top-2) beside every layer's MLP; no per-layer inputs, no sharing,
# full layers with their own v_proj (head_dim 32, 2 KV heads)
GEMMA4_MOE = dict(
    num_hidden_layers=4, sliding_window=WINDOW, global_head_dim=32, hidden_size_per_layer_input=0,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
# a vision tower as small as its config class allows: served text only, it is never run
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                   patch_size=14)

# family -> (config class, model class, config overrides); a vision-language model's overrides name
# its text config (class, overrides on SMALL) and its vision config (class, kwargs)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict()),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
        num_hidden_layers=4)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_TEXT),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        max_position_embeddings=512, original_max_position_embeddings=128,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                             short_factor=_rotary_factors(4, 1), long_factor=_rotary_factors(4, 2)))),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    # layers 0-2 slide, 3 is full (OLMo 3's default pattern); YaRN on the full layer only, as released
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        sliding_window=WINDOW, num_hidden_layers=4,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                            "original_max_position_embeddings": 64, "attention_factor": 1.2}})),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4, no_rope_layer_interval=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # 8 experts in 4 groups, the best 2 groups eligible; layer 0 dense; half the head rotary (the
    # config class's default); q/k/v bias and per-head q/k norm
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        use_qk_norm=True, attention_bias=True, num_hidden_layers=4)),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(rope_parameters=MINISTRAL3_ROPE)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3),
    # layers 0 and 2 slide, 1 is full (the config class's alternation); attention sinks (spread out in
    # build_family), biases on q/k/v/o, the router and the experts; the SwiGLU clamped at 1 (so that
    # the clamp bites at this scale); YaRN as released, on a 64-token original context
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=WINDOW, swiglu_limit=1.0,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, original_max_position_embeddings=64,
                             beta_fast=32.0, beta_slow=1.0, truncate=False))),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", LLAMA4_TEXT),
    # vision-language checkpoints served text only; the head untied here (in the checkpoint), tied
    # (absent from it) in Gemma 3's; Gemma 3's VLM head applies no final soft-capping, its text model's would
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
        tie_word_embeddings=False, text_config=("Ministral3Config", dict(rope_parameters=MINISTRAL3_ROPE)),
        vision_config=("PixtralVisionConfig", dict(TINY_VISION, head_dim=16)))),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        mm_tokens_per_image=4, text_config=("Gemma3TextConfig", dict(GEMMA3_TEXT, final_logit_softcapping=8.0)),
        vision_config=("SiglipVisionConfig", TINY_VISION))),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_TEXT),
    "gemma4_text_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_MOE),
    # served text only: its vision tower (and its projection, embed_vision) skipped; no audio tower
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration", dict(
        text_config=("Gemma4TextConfig", GEMMA4_TEXT),
        vision_config=("Gemma4VisionConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=2, head_dim=16)))),
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration", dict(
        text_config=("Llama4TextConfig", LLAMA4_TEXT),
        vision_config=("Llama4VisionConfig", dict(TINY_VISION, vision_output_dim=64, projector_input_dim=64,
                                                  projector_output_dim=64)))),
}
VISION_LANGUAGE = ("mistral3", "gemma3", "llama4", "gemma4")
# the spread of random biases; GLM's v bias passes through attention whole and, at 0.5, drowns the
# token embeddings (every prompt's greedy output collapsed to one or two tokens)
BIAS_STD: dict[str, float] = {"glm4_moe": 0.1}
NON_LLAMA = [f for f in FAMILIES if f != "llama"]


def build_family(family: str, out: Path, tokenizer_dir: Path) -> Path:
    import transformers

    config_name, model_name, overrides = FAMILIES[family]
    overrides = dict(overrides)
    if "text_config" in overrides:  # a vision-language model around a text model
        text_class, text_overrides = overrides.pop("text_config")
        vision_class, vision_kwargs = overrides.pop("vision_config")
        config = getattr(transformers, config_name)(
            text_config=getattr(transformers, text_class)(**{**SMALL, **text_overrides}),
            vision_config=getattr(transformers, vision_class)(**vision_kwargs), **overrides)
    else:
        config = getattr(transformers, config_name)(**{**SMALL, **overrides})
    torch.manual_seed(sum(map(ord, family)))
    model = getattr(transformers, model_name)(config).eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and not name.endswith("embed_tokens.weight"):
                param.mul_(5.0)  # far from near-uniform logits (conftest's tiny_model_dir)
            elif name.endswith("norm.weight"):
                # norms off their init (a norm loaded wrong changes the output), the final one
                # large (top logits far apart); Gemma stores (w - 1)
                param.add_(0.2 * torch.randn_like(param))
                if name in ("model.norm.weight", "model.language_model.norm.weight"):
                    param.add_(29.0 if gemma else 0.0).mul_(1.0 if gemma else 30.0)
            elif name.endswith("bias"):
                param.normal_(0.0, BIAS_STD.get(family, 0.5))
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4: init 1; spread
                param.add_(0.3 * torch.randn_like(param))
            elif name.endswith("self_attn.sinks"):  # gpt-oss: init near 0; spread, so a dropped sink shows
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4: init 1; spread, so a dropped one shows
                buffer.uniform_(0.5, 1.5)
            if name.endswith("e_score_correction_bias"):  # GLM's router: the choice shifted per expert
                buffer.normal_(0.0, 0.3)
    return save_with_tokenizer(model, out, tokenizer_dir)


def save_with_tokenizer(model: Any, out: Path, tokenizer_dir: Path) -> Path:
    """`model` saved to `out` beside the default model's tokenizer and chat template."""
    model.save_pretrained(out)
    for name in os.listdir(tokenizer_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja") or name == "special_tokens_map.json":
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def built_once(build: Any, built: dict[str, Path], tmp_path_factory: Any, tokenizer_dir: Path) -> Any:
    """get(family) -> its tiny model's directory, built by `build` once per session (`built` keeps them)."""
    def get(family: str) -> Path:
        if family not in built:
            built[family] = build(family, tmp_path_factory.mktemp(f"tiny-{family}"), tokenizer_dir)
        return built[family]

    return get


_DIRS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, default_model_dir):
    return built_once(build_family, _DIRS, tmp_path_factory, default_model_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(4321)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


_HF: dict[tuple[str, tuple[int, ...]], tuple[list[int], list[float]]] = {}
_HF_MODELS: dict[str, Any] = {}


def hf_model(model_dir: Path) -> Any:
    """transformers' model of the checkpoint, float32; a vision-language one whole (given text only,
    it runs its language model and head: the text model Baton serves)."""
    if str(model_dir) not in _HF_MODELS:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        vision_language = json.loads((model_dir / "config.json").read_text())["model_type"] in VISION_LANGUAGE
        auto = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
        _HF_MODELS[str(model_dir)] = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_MODELS[str(model_dir)]


def hf_reference(model_dir: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their log-probabilities (of the raw logits: what Baton reports)."""
    key = (str(model_dir), tuple(prompt))
    if key not in _HF:
        from transformers import GenerationConfig

        model = hf_model(model_dir)
        config = GenerationConfig(do_sample=False, max_new_tokens=N, eos_token_id=None, pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens)]
        assert len(tokens) == N
        _HF[key] = (tokens, logprobs)
    return _HF[key]


def hf_greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    return hf_reference(model_dir, prompt)[0]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ------------------------------------------------------------------ greedy parity, float32

@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family, family_dir, prompts):
    model_dir = family_dir(family)
    expected = [hf_greedy(model_dir, p) for p in prompts]
    assert len({t for r in expected for t in r}) >= 8  # not one repeated token: the model is fit for parity
    # batched, prompts of different lengths
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128)
    assert llm.engine.runtime.model.path == "torch"
    outputs = llm.generate(prompts, greedy())
    assert tokens_of(outputs) == expected
    # and the same numbers: what greedy cannot see (final soft-capping, logits scaling) shows here
    for out, prompt in zip(outputs, prompts):
        assert out.outputs[0].logprobs == pytest.approx(hf_reference(model_dir, prompt)[1], abs=5e-4)
    # chunked prefill: 8 tokens a step, decode mixed with the chunks of other requests
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    # preempted and recomputed: 4-token blocks, 21 in all (the 70-token request alone needs 20;
    # an all-window model frees the blocks behind its window, so it may fit without preemption; a
    # model whose window layers have tables of their own takes a block per table for a position)
    tables = kv_groups(ModelConfig.from_dir(model_dir)).num_tables
    llm = LLM(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=20 * tables + 1)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    if freeable_window(llm.engine.model_config) is None:
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert llm.engine.block_manager.num_released_blocks > 0


def test_the_window_matters(family_dir, prompts):
    """The sliding-window oracle is meaningful: the same model with its window turned off gives
    other tokens for prompts longer than the window (so a Baton ignoring it would fail above)."""
    model_dir = family_dir("mistral")
    config = json.loads((model_dir / "config.json").read_text())
    unwindowed = model_dir.parent / "mistral-no-window"
    if not unwindowed.exists():
        shutil.copytree(model_dir, unwindowed)
        (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    long_prompts = [p for p in prompts if len(p) > WINDOW]
    assert [hf_greedy(unwindowed, p) for p in long_prompts] != [hf_greedy(model_dir, p) for p in long_prompts]


# ------------------------------------------------------------------ bf16 and the path each family takes

@pytest.mark.parametrize("family", NON_LLAMA)
def test_bf16_runs_on_the_torch_path(family, family_dir, prompts):
    llm = LLM(model=str(family_dir(family)), dtype="bfloat16", num_kv_blocks=128, max_num_batched_tokens=32)
    model = llm.engine.runtime.model
    plain = not model.config.native_unsupported()  # qwen2 (bias only): the native kernels run it
    assert model.path == ("native" if plain and model.fused_norm is not None else "torch"), model.describe()
    if not plain:
        assert model.fused_norm is None and model.layers_plan is None
        assert "torch path" in model.describe()
        # where the attention itself is plain (Qwen3's q/k norms, Phi-3's partial rotary...), decode
        # queries attend natively in place (no padded groups); a window, soft-capping or sinks on any
        # layer keeps the torch path's padded groups for the step
        attns = [layer.self_attn for layer in model.layers]
        plain_attention = model.fused_norm is None and all(model._attends_plainly(a) for a in attns)
        native = llm.engine.runtime.model.layers[0].self_attn.backend.paged_kernel is not None
        assert llm.engine.runtime.runner.pads_decode == (not (plain_attention and native)), family
        if family == "qwen3" and native:
            assert not llm.engine.runtime.runner.pads_decode
            assert f"decode attention native on {len(attns)} of {len(attns)} layers" in model.describe()
    outputs = tokens_of(llm.generate(prompts, greedy()))
    assert all(len(t) == N and all(0 <= x < VOCAB for x in t) for t in outputs)


# ------------------------------------------------------------------ the loader is strict

def _edit_checkpoint(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def test_a_checkpoint_with_an_unknown_tensor_is_refused_by_name(family_dir, tmp_path):
    def add(tensors):
        tensors["model.layers.0.self_attn.mystery_gate.weight"] = torch.zeros(4, 64)

    bad = _edit_checkpoint(family_dir("qwen3"), tmp_path / "extra", add)
    with pytest.raises(ValueError, match=r"does not use: layers\.0\.self_attn\.mystery_gate\.weight"):
        LLM(model=str(bad), dtype="float32", num_kv_blocks=16)


def test_a_checkpoint_missing_a_tensor_is_refused_by_name(family_dir, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.self_attn.k_norm.weight"]
        del tensors["model.layers.0.mlp.up_proj.weight"]

    bad = _edit_checkpoint(family_dir("qwen3"), tmp_path / "missing", drop)
    with pytest.raises(ValueError) as info:
        LLM(model=str(bad), dtype="float32", num_kv_blocks=16)
    assert "layers.1.self_attn.k_norm.weight" in str(info.value)
    assert "layers.0.mlp.up_proj.weight" in str(info.value)


def test_qwen3_weights_under_a_llama_config_are_refused(family_dir, tmp_path):
    """Qwen3's q/k norms forced past the type check (model_type llama) are unused tensors: refused,
    not loaded silently into a model that would ignore them."""
    bad = tmp_path / "qwen3-as-llama"
    shutil.copytree(family_dir("qwen3"), bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="q_norm"):
        LLM(model=str(bad), dtype="float32", num_kv_blocks=16)


def test_an_unknown_model_type_names_the_supported_ones(family_dir, tmp_path):
    from baton.model.config import ModelConfig

    bad = tmp_path / "unknown"
    bad.mkdir()
    config = json.loads((family_dir("qwen3") / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'.*gemma2.*qwen3_moe"):
        ModelConfig.from_dir(bad)


# ------------------------------------------------------------------ vision-language checkpoints, served text only

def assert_towers_skipped(model_dir: Path, prefixes: tuple[str, ...], what: str, caplog: Any) -> int:
    """Load `model_dir` and check the log counts its tensors under `prefixes` as skipped by the named
    rule ("skipping <what>: N tensors"); returns N."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        towers = sum(1 for n in f.keys() if n.startswith(prefixes))
    assert towers
    with caplog.at_level("INFO", logger="baton.model.loader"):
        LLM(model=str(model_dir), dtype="float32", num_kv_blocks=16)
    assert f"skipping {what}: {towers} tensors" in caplog.text
    return towers


def test_a_vision_language_checkpoint_skips_its_vision_tower_by_name(family_dir, tmp_path, caplog):
    """The vision tower and projector are skipped by the named rule, counted in the log; any other
    tensor the text model does not use is still refused by name."""
    model_dir = family_dir("mistral3")
    assert_towers_skipped(model_dir, ("vision_tower.", "multi_modal_projector."), "the vision tower", caplog)

    def add(tensors):
        tensors["language_model.model.layers.0.self_attn.mystery_gate.weight"] = torch.zeros(4, 64)
        tensors["audio_tower.proj.weight"] = torch.zeros(4, 64)

    bad = _edit_checkpoint(model_dir, tmp_path / "extra", add)
    with pytest.raises(ValueError, match=r"does not use: audio_tower\.proj\.weight, "
                                         r"layers\.0\.self_attn\.mystery_gate\.weight"):
        LLM(model=str(bad), dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize("family", VISION_LANGUAGE)
def test_a_vision_language_checkpoint_in_transformers_5_module_names(family, family_dir, prompts, tmp_path):
    """save_pretrained writes the 4.x names (language_model.model.*, language_model.lm_head.*);
    the same weights under the names of transformers 5's modules (model.language_model.*, lm_head.*,
    model.vision_tower.*) are the same text model."""
    def rename(tensors):
        for name in list(tensors):
            new = name.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.",
                                                                                          "lm_head.")
            if new.startswith(("vision_tower.", "multi_modal_projector.")):
                new = "model." + new
            tensors[new] = tensors.pop(name)

    model_dir = family_dir(family)
    renamed = _edit_checkpoint(model_dir, tmp_path / family, rename)
    llm = LLM(model=str(renamed), dtype="float32", num_kv_blocks=128)
    assert tokens_of(llm.generate(prompts, greedy())) == [hf_greedy(model_dir, p) for p in prompts]


def test_a_gemma3_config_written_by_transformers_4_reads_as_transformers_reads_it(tmp_path):
    """transformers 4.x wrote a text_config holding only what differs from Gemma3TextConfig's defaults
    (google/gemma-3-4b-it's, below); the missing numbers are the class's defaults, the rope scaling is
    the global layers' only, and every 6th layer is global."""
    from transformers import AutoConfig

    from baton.model.config import ModelConfig

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "image_token_index": 262144, "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                             "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    text = AutoConfig.from_pretrained(tmp_path).text_config
    config = ModelConfig.from_dir(tmp_path)
    assert (config.model_type, config.text_only_of) == ("gemma3_text", "gemma3")
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim) == (text.vocab_size, 2560, 34, text.num_attention_heads, text.num_key_value_heads,
                                 text.head_dim)
    assert config.scale == text.query_pre_attn_scalar ** -0.5 and config.sliding_window == 1024
    assert [("sliding" if s else "full") + "_attention" for s in config.layer_sliding] == text.layer_types
    full, sliding = text.rope_parameters["full_attention"], text.rope_parameters["sliding_attention"]
    assert (config.rope_theta, config.rope_scaling["rope_type"], config.rope_scaling["factor"]) == (
        full["rope_theta"], full["rope_type"], full["factor"])
    assert (config.rope_theta_local, config.rope_scaling_local) == (sliding["rope_theta"], None)
    assert sliding["rope_type"] == "default" and config.eos_token_ids[:2] == [1, 106]


# ------------------------------------------------------------------ GLM-4.5's multi-token-prediction layer

@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_glm_mtp_layer_tensors_are_skipped_by_name(family, family_dir, prompts, tmp_path, caplog):
    """GLM-4.5 (and DeepSeek V3) checkpoints carry their MTP layer (`num_nextn_predict_layers`) after
    the last layer; Baton does not run it: its tensors are skipped, counted in the log, and the model
    is the same. A layer past it is still an unknown tensor, refused by name."""
    model_dir = family_dir(family)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["num_nextn_predict_layers"] == 1
    mtp = ["eh_proj.weight", "enorm.weight", "hnorm.weight", "self_attn.q_proj.weight", "shared_head.norm.weight"]

    def add_mtp(tensors):
        for name in mtp:
            tensors[f"model.layers.4.{name}"] = torch.zeros(4, 64)

    with_mtp = _edit_checkpoint(model_dir, tmp_path / "mtp", add_mtp)
    with caplog.at_level("INFO", logger="baton.model.loader"):
        llm = LLM(model=str(with_mtp), dtype="float32", num_kv_blocks=128)
    assert f"skipping the multi-token-prediction layers: {len(mtp)} tensors" in caplog.text
    assert tokens_of(llm.generate(prompts, greedy())) == [hf_greedy(model_dir, p) for p in prompts]

    def add_beyond(tensors):
        tensors["model.layers.5.eh_proj.weight"] = torch.zeros(4, 64)

    bad = _edit_checkpoint(with_mtp, tmp_path / "beyond", add_beyond)
    with pytest.raises(ValueError, match=r"does not use: layers\.5\.eh_proj\.weight"):
        LLM(model=str(bad), dtype="float32", num_kv_blocks=16)


# ------------------------------------------------------------------ DeepSeek V3: multi-head latent attention

def test_mla_caches_the_latent_and_the_rotary_key_only(family_dir):
    """A token's KV per layer is its latent and its rotary key, cached as one KV head of width
    kv_lora_rank + qk_rope_head_dim (K, and the same vector as V): (32 + 8) * 2 values, where the
    expanded K/V would be heads * (qk_head_dim + v_head_dim) = 4 * (24 + 16)."""
    from baton.model.config import ModelConfig
    from baton.model.runtime import kv_block_bytes

    model_dir = family_dir("deepseek_v3")
    config = ModelConfig.from_dir(model_dir)
    assert (config.num_kv_heads, config.head_dim) == (1, 32 + 8)
    per_token_layer = (32 + 8) * 2
    assert kv_block_bytes(config, 16, dtype="float32") == 4 * 16 * per_token_layer * 4
    runtime = LLM(model=str(model_dir), dtype="bfloat16", num_kv_blocks=16).engine.runtime
    assert runtime.block_bytes(16) == 4 * 16 * per_token_layer * 2
    assert list(runtime.block_shape) == [4, 2, 16, 1, 32 + 8]


def test_mla_softmax_scale_is_transformers(family_dir):
    """qk_head_dim ** -0.5 times YaRN's mscale(factor, mscale_all_dim) squared, as the reference."""
    from baton.model.config import ModelConfig

    model_dir = family_dir("deepseek_v3")
    scale = ModelConfig.from_dir(model_dir).scale
    assert scale == pytest.approx(hf_model(model_dir).model.layers[0].self_attn.scaling, rel=1e-12)
    assert scale != pytest.approx((16 + 8) ** -0.5)  # the mscale is in this model


def test_mla_interleaved_rotary_is_reordered_at_load(family_dir, prompts, monkeypatch):
    """DeepSeek rotates interleaved pairs (2i, 2i + 1) of q_pe and k_pe; the loader reorders those
    rows to Baton's half-split pairs: without it, Baton's tokens are not transformers'."""
    from baton.model import loader

    model_dir = family_dir("deepseek_v3")
    expected = [hf_greedy(model_dir, p) for p in prompts]
    monkeypatch.setattr(loader, "half_split_rows", lambda rows, width, rope: rows)
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128)
    assert tokens_of(llm.generate(prompts, greedy())) != expected


def test_mla_with_a_direct_q_proj_biases_and_a_half_split_rotary(default_model_dir, prompts, tmp_path, monkeypatch):
    """The other forms of the MLA layer: q_lora_rank None (one q_proj), attention biases (q_a/kv_a
    and o), `rope_interleave` off; greedy float32 equal to transformers' with chunked prefill."""
    variant = dict(DEEPSEEK_V3, q_lora_rank=None, attention_bias=True, rope_interleave=False)
    monkeypatch.setitem(FAMILIES, "deepseek_v3_variant", ("DeepseekV3Config", "DeepseekV3ForCausalLM", variant))
    monkeypatch.setitem(BIAS_STD, "deepseek_v3_variant", 0.1)
    model_dir = build_family("deepseek_v3_variant", tmp_path / "variant", default_model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["q_lora_rank"] is None and config["rope_interleave"] is False
    expected = [hf_greedy(model_dir, p) for p in prompts]
    assert len({t for r in expected for t in r}) >= 8
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8)
    assert tokens_of(llm.generate(prompts, greedy())) == expected


def test_a_deepseek_v3_config_as_released_reads_as_transformers_reads_it(tmp_path):
    """deepseek-ai/DeepSeek-V3's config.json (transformers 4.33's keys: rope_scaling with `type`):
    the cache row (one head of 512 + 64), the softmax scale with YaRN's mscale_all_dim, the rotary
    frequencies over qk_rope_head_dim, the routing and the dense first layers as transformers reads them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from baton.model.config import ModelConfig
    from baton.model.rope import rope_inv_freq

    raw = {"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
           "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
           "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
           "moe_intermediate_size": 2048, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
           "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
           "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "tie_word_embeddings": False, "topk_group": 4, "v_head_dim": 128, "vocab_size": 129280}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoConfig.from_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    assert (config.num_kv_heads, config.head_dim, config.kv_lora_rank, config.q_lora_rank) == (1, 576, 512, 1536)
    assert config.scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim ** -0.5), rel=1e-12)
    assert config.rope_interleaved and config.mtp_layers == 1
    assert (config.router, config.n_group, config.topk_group, config.num_shared_experts) == ("sigmoid_grouped", 8, 4, 1)
    assert config.layer_moe == [i >= 3 for i in range(61)] and config.norm_topk_prob
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    got = rope_inv_freq(config)
    assert got[0].shape == (32,) and torch.allclose(got[0], inv_freq) and got[1] == pytest.approx(attention_factor)


# ------------------------------------------------------------------ RoPE scaling, as transformers computes it

ROPE_CASES = {
    "default": dict(rope_type="default"),
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
    "yarn-mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=0.7,
                        mscale_all_dim=1.0, beta_fast=16.0),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=128, short_factor=_rotary_factors(8, 3),
                     long_factor=_rotary_factors(8, 4)),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_frequencies_equal_transformers(case, tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from baton.model.config import ModelConfig
    from baton.model.rope import rope_inv_freq, rope_table

    params = {"rope_theta": 10000.0, **ROPE_CASES[case]}
    hf_config = LlamaConfig(**{**SMALL, "max_position_embeddings": 512}, rope_parameters=params)
    hf_config.save_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    rope_type = params["rope_type"]
    for seq_len in (None, 100, 2048):  # within the original context, and beyond every context
        if rope_type == "default":
            expected = (1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
        else:
            expected = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, seq_len=seq_len)
        got = rope_inv_freq(config, seq_len=seq_len)
        assert torch.equal(got[0], expected[0].float()), seq_len
        assert got[1] == pytest.approx(expected[1], rel=1e-12)
    if rope_type == "longrope":
        # per position: the short factors below the original context, the long ones from there on
        cos, _ = rope_table(config, 512, torch.float32, "cpu")
        short, long_ = rope_inv_freq(config, seq_len=None), rope_inv_freq(config, seq_len=512)
        assert torch.equal(cos[127, :8], (127 * short[0]).cos() * short[1])
        assert torch.equal(cos[300, :8], (300.0 * long_[0]).cos() * long_[1])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "glm4_moe", "gemma4_text_moe"])
def test_int8_weights_run_on_the_torch_path_with_moe_experts_in_q8_0(family, family_dir, prompts):
    """--quantization int8 on a family outside the native path: every dense projection is int8 (GLM's
    shared experts too: a dense MLP), each routed expert's (Gemma 4's beside its MLP too) gate_up and down a Q8_0 op (run by
    baton.model.moe) with no dense expert stack left, and generation works."""
    from baton.model.linear import QuantizedLinear
    from baton.model.moe_quant import moe_layers

    llm = LLM(model=str(family_dir(family)), dtype="bfloat16", num_kv_blocks=128, quantization="int8")
    model = llm.engine.runtime.model
    assert all(isinstance(getattr(owner, name), QuantizedLinear) for owner, name, _ in model.projection_slots())
    assert not [n for n, _ in model.named_parameters() if n.endswith(("experts_gate_up", "experts_down"))]
    moes = moe_layers(model)
    assert (family != "qwen3") == bool(moes)
    assert all(moe.expert_ops is not None and len(moe.expert_ops) == moe.num_experts for moe in moes)
    assert all(isinstance(op, QuantizedLinear) and op.scheme == "q8_0" for moe in moes for pair in moe.expert_ops
               for op in pair)
    outputs = tokens_of(llm.generate(prompts, greedy()))
    assert all(len(t) == N and all(0 <= x < VOCAB for x in t) for t in outputs)


# ------------------------------------------------------------------ bf16: transformers' tokens but at near-ties

@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_greedy_is_transformers_but_at_near_ties(family, family_dir, prompts):
    """The serving dtype: every one of the first 16 greedy bf16 tokens is transformers' float32
    argmax after the same tokens (teacher-forced along Baton's output), or a near-tie there: within
    3% of the row's logit spread (max - median) of it. bf16's rounding through the layers measured
    up to ~2% on these models; a wrong kernel, mask or norm misses by far more."""
    model_dir = family_dir(family)
    hf = hf_model(model_dir)
    assert_bf16_near_ties_only(LLM(model=str(model_dir), dtype="bfloat16", num_kv_blocks=128), hf, prompts, family)


def assert_bf16_near_ties_only(llm: LLM, hf: Any, prompts: list[list[int]], family: str) -> None:
    """16 greedy bf16 tokens of prompts 1 and 3 (17 tokens, and 70: past the 24-token window): each
    within 3% of its row's logit spread (max - median) of transformers' float32 top token, or, where
    not, within 3% of the top token of transformers' own bf16 logits at that row (a position where
    bf16 itself moves the logits that far: measured on Zen 4's bf16 matmuls, transformers' bf16 moved
    a Qwen3.5 token's logprob by 3 nats there); most of them exactly a reference's top token, float32's
    or transformers' own bf16's (near-ties are the exception: a model whose logits crowd, as Gemma 4's
    soft-capped ones do, has more of them, and bf16 on AMX picks other sides of them than on Zen 4's
    AVX512-BF16: 18 of 32 were float32's top token there, 28 one of the two)."""
    import copy

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    exact, chosen = 0, [prompts[1], prompts[3]]
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for prompt, out in zip(chosen, llm.generate(chosen, params)):
        got = out.outputs[0].token_ids
        ids = torch.tensor([prompt + got])
        rows = slice(len(prompt) - 1, len(prompt) - 1 + len(got))
        with torch.no_grad():
            logits = hf(ids).logits[0, rows]
            own = hf_bf16(ids).logits[0, rows].float()
        for i, token in enumerate(got):
            margin, allowed = _margin(logits[i], token)
            if margin > allowed:
                own_margin, own_allowed = _margin(own[i], token)
                assert own_margin <= own_allowed, (family, len(prompt), i, margin, own_margin)
            exact += margin == 0 or int(own[i].argmax()) == token
    assert exact >= 0.6 * 16 * len(chosen), (family, exact)


def assert_first_tokens_near_ties(llm: LLM, hf: Any, prompts: list[list[int]]) -> None:
    """Each prompt's first greedy token within 3% of its logit spread of transformers' float32 top
    token (the check for a model whose later tokens drift apart at rounding: a tiny MoE's routing)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1]
        margin, allowed = _margin(logits, out.outputs[0].token_ids[0])
        assert margin <= allowed, (len(prompt), margin, allowed)


def _margin(row: torch.Tensor, token: int) -> tuple[float, float]:
    """How far `token` is below the row's top logit, and 3% of the row's spread (max - median)."""
    return float(row.max() - row[token]), 0.03 * float(row.max() - row.median())


# ------------------------------------------------------------------ gpt-oss: sinks, the clamp, MXFP4 experts

def _with_config(src: Path, dst: Path, **changes: Any) -> Path:
    if not dst.exists():
        shutil.copytree(src, dst)
        config = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_gpt_oss_sinks_and_clamp_matter(family_dir, prompts, tmp_path):
    """The gpt-oss oracle is meaningful: transformers' greedy tokens change with the attention sinks
    zeroed, and with the SwiGLU's clamp lifted, so a Baton without either would fail the parity above."""
    model_dir = family_dir("gpt_oss")
    expected = [hf_greedy(model_dir, p) for p in prompts]

    def zero_sinks(tensors):
        for name in tensors:
            if name.endswith("self_attn.sinks"):
                tensors[name] = torch.zeros_like(tensors[name])

    no_sinks = _edit_checkpoint(model_dir, tmp_path / "no-sinks", zero_sinks)
    assert [hf_greedy(no_sinks, p) for p in prompts] != expected
    unclamped = _with_config(model_dir, tmp_path / "unclamped", swiglu_limit=1e9)
    assert [hf_greedy(unclamped, p) for p in prompts] != expected


# ------------------------------------------------------------------ Llama 4: chunks, temperature, q/k norm, rotary

def test_llama4_chunks_temperature_and_qk_norm_matter(family_dir, prompts, tmp_path):
    """The Llama 4 oracle is meaningful: transformers' greedy tokens change without the chunk mask (for
    prompts crossing a chunk boundary), without the temperature tuning and without the L2 q/k norm, so
    a Baton missing any would fail the parity above."""
    model_dir = family_dir("llama4_text")
    long_prompts = [p for p in prompts if len(p) > CHUNK]
    expected = [hf_greedy(model_dir, p) for p in long_prompts]
    unchunked = _with_config(model_dir, tmp_path / "unchunked", attention_chunk_size=None,
                             layer_types=["full_attention"] * 4)
    assert [hf_greedy(unchunked, p) for p in long_prompts] != expected
    untuned = _with_config(model_dir, tmp_path / "untuned", attn_temperature_tuning=False)
    assert [hf_greedy(untuned, p) for p in long_prompts] != expected
    unnormed = _with_config(model_dir, tmp_path / "unnormed", use_qk_norm=False)
    assert [hf_greedy(unnormed, p) for p in long_prompts] != expected


def test_a_llama4_scout_style_config_reads_as_transformers_reads_it(tmp_path):
    """A Llama 4 Scout-style vision-language config.json (4.51's keys: rope_scaling, an empty
    no_rope_layers, no moe_layers / layer_types): its no-rotary, chunked and MoE layers, sizes and
    temperature tuning as transformers' Llama4Config reads them."""
    from transformers import AutoConfig

    from baton.model.config import ModelConfig

    text = {"attention_bias": False, "attention_chunk_size": 8192, "attn_scale": 0.1, "attn_temperature_tuning": True,
            "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008], "floor_scale": 8192, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": 5120, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
            "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760, "model_type": "llama4_text",
            "no_rope_layers": [], "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
            "num_key_value_heads": 8, "num_local_experts": 16, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "use_qk_norm": True, "vocab_size": 202048}
    raw = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
           "vision_config": {"model_type": "llama4_vision_model"}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoConfig.from_pretrained(tmp_path).text_config
    config = ModelConfig.from_dir(tmp_path)
    assert config.text_only_of == "llama4" and config.model_type == "llama4_text"
    assert config.layer_rope == [bool(v) for v in hf.no_rope_layers] and config.layer_rope.count(False) == 12
    assert config.layer_sliding == [t == "chunked_attention" for t in hf.layer_types]
    assert config.chunked_window and config.sliding_window == hf.attention_chunk_size
    assert config.layer_moe == [i in hf.moe_layers for i in range(48)] and all(config.layer_moe)
    assert (config.intermediate_size, config.moe_intermediate_size, config.num_shared_experts) == (16384, 8192, 1)
    assert (config.router, config.expert_form, config.qk_norm, config.rope_interleaved) == (
        "sigmoid_input", "llama4", "l2", True)
    assert (config.attn_temperature_scale, config.attn_temperature_floor) == (hf.attn_scale, hf.floor_scale)
    assert (config.rope_scaling or {}).get("rope_type") == "llama3" and config.rope_theta == 500000.0
    assert {"chunked attention", "attention temperature", "MoE"} <= set(config.native_unsupported())


def test_llama4_interleaved_rotary_is_reordered_at_load(family_dir, prompts, monkeypatch):
    """Llama 4 rotates interleaved pairs (2i, 2i + 1); Baton's rotary pairs (i, i + d/2), so the
    loader reorders q/k rows: without that reordering Baton's tokens are not transformers'."""
    from baton.model import loader

    model_dir = family_dir("llama4_text")
    expected = [hf_greedy(model_dir, p) for p in prompts]
    monkeypatch.setattr(loader, "_half_split_qk", lambda qkv, config: qkv)
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128)
    assert tokens_of(llm.generate(prompts, greedy())) != expected


def with_mxfp4_experts(model_dir: Path, out: Path, packed: dict[str, tuple[torch.Tensor, torch.Tensor]]
                       ) -> tuple[Path, Path]:
    """`model_dir`'s checkpoint with the expert tensors `packed` names as MXFP4 (`*_blocks` + `*_scales`,
    quant_method mxfp4, as gpt-oss ships them: out/mxfp4), and the same model holding transformers'
    dequantization of them as dense tensors (out/dequantized)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    def to_mxfp4(tensors):
        for name, (blocks, scales) in packed.items():
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales

    def to_dequantized(tensors):
        for name, (blocks, scales) in packed.items():
            tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)

    mxfp4 = _edit_checkpoint(model_dir, out / "mxfp4", to_mxfp4)
    config = json.loads((mxfp4 / "config.json").read_text())
    (mxfp4 / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}))
    return mxfp4, _edit_checkpoint(model_dir, out / "dequantized", to_dequantized)


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(family_dir, prompts, tmp_path):
    """A checkpoint with MXFP4 experts (`*_blocks` + `*_scales`, quant_method mxfp4, as gpt-oss ships):
    Baton loads each expert weight equal to transformers' dequantization of it, and its greedy tokens
    equal transformers' on the checkpoint holding those dequantized weights."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from baton.model.loader import load_model

    model_dir = family_dir("gpt_oss")
    original = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, tensor in original.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = tensor.shape  # stored input-major: [E, in, out]
            blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8,
                                   generator=generator)
            scales = torch.randint(120, 125, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=generator)
            packed[name] = (blocks, scales)
    assert len(packed) == 2 * 3
    mxfp4, dequantized = with_mxfp4_experts(model_dir, tmp_path, packed)

    from baton.model.mxfp4 import dequantize

    for blocks, scales in packed.values():  # Baton's dequantization is transformers', bit for bit
        for dtype in (torch.float32, torch.bfloat16):
            reference = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
            assert torch.equal(dequantize(blocks, scales, dtype), reference)
    from_mxfp4, _ = load_model(mxfp4, dtype="float32", device="cpu", prepare=False)
    from_dense, _ = load_model(dequantized, dtype="float32", device="cpu", prepare=False)
    dense = dict(from_dense.named_parameters())
    experts = [n for n, _ in from_mxfp4.named_parameters() if n.endswith(("experts_gate_up", "experts_down"))]
    assert len(experts) == 6
    for name, param in from_mxfp4.named_parameters():
        assert torch.equal(param, dense[name]), name
    llm = LLM(model=str(mxfp4), dtype="float32", num_kv_blocks=128)
    assert tokens_of(llm.generate(prompts, greedy())) == [hf_greedy(dequantized, p) for p in prompts]


def test_a_gpt_oss_config_as_released_reads_as_transformers_reads_it(tmp_path):
    """openai/gpt-oss-20b's config.json (transformers 4.55's keys: rope_scaling, MXFP4 quantization):
    its windows, experts, clamp and YaRN frequencies (`truncate: false`) as transformers reads them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from baton.model.config import ModelConfig
    from baton.model.rope import rope_inv_freq

    raw = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
           "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
               "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoConfig.from_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 4, 2880)
    assert (config.router, config.expert_form, config.swiglu_limit, config.swiglu_alpha) == (
        "topk_softmax", "gpt_oss", hf.swiglu_limit, hf.swiglu_alpha)
    assert config.attention_bias and config.o_bias and config.attention_sinks and config.sliding_window == 128
    assert [("sliding" if s else "full") + "_attention" for s in config.layer_sliding] == hf.layer_types
    assert "attention sinks" in config.native_unsupported()
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    got = rope_inv_freq(config)
    assert torch.equal(got[0], inv_freq.float()) and got[1] == pytest.approx(attention_factor, rel=1e-12)


# ------------------------------------------------------------------ Gemma 4: per-layer shapes, KV sharing, its cache

def test_gemma4_caches_its_unshared_layers_each_in_its_own_shape(family_dir, prompts):
    """Layers 4 and 5 attend the K/V of layers 3 and 2 (transformers' kv_sharing_modes) and keep no
    cache; the 4 cached layers are packed each in its own (kv_heads, head_dim), no slot padded
    (docs/design-decisions.md, decision 29), while a block in the store has every family's uniform
    form, padded to the widest (2 KV heads of 32). An int8 cache (rows of head_dim + 4 scale bytes)
    runs: its first two tokens (the second read from the cache) are float32's; one of its blocks,
    handed to a float32 worker, holds there the values each layer read, and comes back from the store
    form as it was."""
    from transformers import AutoConfig

    from baton.model.config import ModelConfig
    from baton.model.kv_quant import dequantize_rows
    from baton.model.layer_cache import layer_views
    from baton.model.runtime import kv_block_bytes

    model_dir = family_dir("gemma4_text")
    hf = AutoConfig.from_pretrained(model_dir)
    config = ModelConfig.from_dir(model_dir)
    assert config.layer_head_dim == [hf.per_layer_config[i].head_dim for i in range(6)] == [16, 16, 32, 16, 16, 32]
    assert config.layer_kv_heads == [hf.per_layer_config[i].num_key_value_heads for i in range(6)] == [2, 2, 1, 2, 2, 1]
    assert config.layer_kv_source == [0, 1, 2, 3, 3, 2] and config.attention_layers == [0, 1, 2, 3]
    assert [m == "reuse" for m in hf.kv_sharing_modes] == [s != i for i, s in enumerate(config.layer_kv_source)]
    # 3 sliding layers of 2 x 16 and a full one of 1 x 32, K and V, 16 slots, fp32 (padded: 4 x 2 x 32)
    assert kv_block_bytes(config, 16, dtype="float32") == (3 * 2 * 16 + 32) * 2 * 16 * 4
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128)
    assert list(llm.engine.runtime.block_shape) == [4, 2, 16, 2, 32]
    assert "Gemma 4 layers" in llm.engine.runtime.model.describe()
    full = tokens_of(llm.generate(prompts, greedy()))
    int8 = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, kv_cache_dtype="int8")
    a, b = int8.engine.runtime.runner, llm.engine.runtime.runner
    assert [tuple(v.shape[1:]) for v in layer_views(a.kv_cache, config)] == [(2, 128 * 16, 16 + 4)] * 2 + [
        (1, 128 * 16, 32 + 4), (2, 128 * 16, 16 + 4)]
    assert [t[:2] for t in tokens_of(int8.generate(prompts, greedy()))] == [t[:2] for t in full]
    block, bs = 1, a.block_size
    stored = a.read_block(block)
    assert list(stored.shape) == [4, 2, bs, 2, 32 + 4]
    b.write_block(block, stored)
    a.write_block(block, stored)
    assert torch.equal(a.read_block(block), stored)
    for quantized, values in zip(layer_views(a.kv_cache, config), layer_views(b.kv_cache, config)):
        quantized, values = quantized[:, :, bs:2 * bs], values[:, :, bs:2 * bs]
        assert values.abs().sum() > 0 and torch.equal(dequantize_rows(quantized, torch.float32), values)


def test_a_gemma4_checkpoint_skips_its_vision_tower_by_name(family_dir, tmp_path, caplog):
    """The gemma4 vision-language checkpoint: its vision tower and embed_vision are skipped by the
    named rule and counted, the audio tower's names by the same rule; K/V weights stored for a
    KV-shared layer (which never runs them: transformers ignores them on load) are skipped by name
    too; any other tensor is refused by name."""
    model_dir = family_dir("gemma4")
    towers = assert_towers_skipped(model_dir, ("model.vision_tower.", "model.embed_vision."),
                                   "the vision and audio towers", caplog)

    def add_shared_kv(tensors):
        tensors["model.audio_tower.proj.weight"] = torch.zeros(4, 64)
        for layer, d in ((4, 16), (5, 32)):  # the shared layers (sliding, full)
            tensors[f"model.language_model.layers.{layer}.self_attn.k_proj.weight"] = torch.zeros(32, 64)
            tensors[f"model.language_model.layers.{layer}.self_attn.k_norm.weight"] = torch.zeros(d)

    shared_kv = _edit_checkpoint(model_dir, tmp_path / "shared-kv", add_shared_kv)
    caplog.clear()
    with caplog.at_level("INFO", logger="baton.model.loader"):
        llm = LLM(model=str(shared_kv), dtype="float32", num_kv_blocks=16)
    assert "skipping the KV-shared layers' K/V weights: 4 tensors" in caplog.text
    assert f"skipping the vision and audio towers: {towers + 1} tensors" in caplog.text
    assert llm.engine.runtime.model.layers[4].self_attn.qkv_proj.weight.shape == (4 * 16, 64)  # q alone

    def add_unknown(tensors):
        tensors["model.language_model.layers.3.self_attn.mystery_gate.weight"] = torch.zeros(4, 64)

    bad = _edit_checkpoint(model_dir, tmp_path / "extra", add_unknown)
    with pytest.raises(ValueError, match=r"does not use: layers\.3\.self_attn\.mystery_gate\.weight$"):
        LLM(model=str(bad), dtype="float32", num_kv_blocks=16)


GEMMA4_RELEASED_STYLE = {
    # no per_layer_config: the global_* keys (Gemma4TextConfig.__post_init__ turns them into one),
    # every 5th layer full, the last 10 layers sharing K/V, K = V on the full layers
    "e2b": {"hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 20, "num_attention_heads": 8,
            "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "num_kv_shared_layers": 10,
            "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 4, "hidden_size_per_layer_input": 256,
            "use_double_wide_mlp": True, "final_logit_softcapping": 30.0},
    "k_eq_v": {"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 12, "num_attention_heads": 32,
               "num_key_value_heads": 16, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
               "attention_k_eq_v": True, "hidden_size_per_layer_input": 0, "sliding_window": 1024},
    # the MoE block beside a narrow MLP (128 experts, top-8), no per-layer inputs, no sharing
    "moe": {"hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 12, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2,
            "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
            "moe_intermediate_size": 704, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
            "sliding_window": 1024},
}


@pytest.mark.parametrize("case", list(GEMMA4_RELEASED_STYLE))
def test_a_gemma4_config_without_per_layer_config_reads_as_transformers_reads_it(case, tmp_path):
    """Head shapes, KV sources, the window and both rotaries (the sliding layers' default, the full
    layers' proportional one: zero frequencies past the rotated quarter) as transformers resolves them."""
    from transformers import AutoConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    from baton.model.config import ModelConfig
    from baton.model.gemma4 import gemma4_inv_freq

    raw = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 262144,
           **GEMMA4_RELEASED_STYLE[case]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoConfig.from_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    layers = range(hf.num_hidden_layers)
    assert config.layer_head_dim == [hf.per_layer_config[i].head_dim for i in layers]
    assert config.layer_kv_heads == [hf.per_layer_config[i].num_key_value_heads for i in layers]
    modes = hf.kv_sharing_modes
    assert [s != i for i, s in enumerate(config.layer_kv_source)] == [m == "reuse" for m in modes]
    assert all(modes[s] == "store" for i, s in enumerate(config.layer_kv_source) if s != i)
    assert config.layer_sliding == [t == "sliding_attention" for t in hf.layer_types]
    assert config.sliding_window == hf.sliding_window and config.tie_word_embeddings
    assert (config.head_dim, config.num_kv_heads) == (512, max(config.layer_kv_heads))
    assert config.gemma4["per_layer_input"] == hf.hidden_size_per_layer_input
    assert (config.gemma4["moe"], config.gemma4["num_experts"], config.gemma4["top_k"],
            config.gemma4["moe_intermediate_size"]) == (hf.enable_moe_block, hf.num_experts or 0, hf.top_k_experts or 0,
                                                        hf.moe_intermediate_size or 0)
    rotary = Gemma4TextRotaryEmbedding(hf)
    for sliding, layer_type in ((True, "sliding_attention"), (False, "full_attention")):
        d = hf.per_layer_config[layer_type].head_dim
        assert torch.equal(gemma4_inv_freq(config, sliding, d), getattr(rotary, f"{layer_type}_inv_freq"))


@pytest.mark.parametrize("change, named", [
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (dict(per_layer_config={"2": {"intermediate_size": 64}}), "per_layer_config keys ['intermediate_size']"),
    (dict(attention_bias=True), "gemma4 with attention_bias"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}}),
     "rope type 'yarn'"),
])
def test_what_gemma4_does_not_run_is_refused_by_name(family_dir, tmp_path, change, named):
    model_dir = _with_config(family_dir("gemma4_text"), tmp_path / "changed", **change)
    with pytest.raises(ValueError, match=re.escape(named)):
        LLM(model=str(model_dir), dtype="float32", num_kv_blocks=16)
