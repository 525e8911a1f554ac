"""Model families as small declarative specs, read by one model (`baton.model.model`).

Rules of this file:
- A `FamilySpec` says what a family's *architecture* is (which norms and where, q/k norm, biases,
  which window scheme, how the embedding is scaled, the MoE router, how its checkpoint names its
  tensors); the numbers (sizes, eps, theta, windows, multipliers) come from each checkpoint's
  `config.json` (`ModelConfig.from_dir`). No family-specific branch lives in the model: it reads
  the fields of `ModelConfig` that `from_dir` derives from the spec.
- Every detail follows transformers' own modeling file for that family
  (transformers/models/<family>/modeling_<family>.py), which is the parity oracle of the tests.
- A vision-language checkpoint whose text model is a family here is served text only, by its
  `TextOnlyForm` (`TEXT_ONLY`): the vision tower's tensors are skipped by name, never silently.
- A model_type missing here is refused by `from_dir`, naming the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

NormKind = Literal["rms", "gemma"]  # gemma: x_hat * (1 + w), the weight stored as an offset from 1
NormPlacement = Literal["pre", "sandwich", "post"]
# head: over head_dim per head; full: over the whole projection; config_head: head where the config's
# `use_qk_norm` says (GLM-4.5)
# l2_config: a weightless RMS norm over head_dim after the rotary, on the rotary layers only, where the
# config's `use_qk_norm` says (Llama 4's L2Norm)
QKNorm = Literal["none", "head", "full", "config_head", "l2_config"]
# chunked: the rotary layers attend only the keys in their own `attention_chunk_size` block of
# positions (Llama 4's chunked attention), the no-rotary layers everything
WindowScheme = Literal["none", "all", "layer_types", "chunked"]
EmbedScale = Literal["none", "sqrt_hidden", "embedding_multiplier"]
# softmax_topk: softmax over the experts, top-k (Mixtral, Qwen3-MoE); sigmoid_grouped: sigmoid scores,
# experts chosen by score + `e_score_correction_bias` within the best `topk_group` of `n_group` groups,
# weighted by their scores times `routed_scaling_factor` (GLM-4.5, DeepSeek-V3); topk_softmax: the
# router (with a bias) picks the top-k logits, softmax over those k alone (gpt-oss)
# sigmoid_input: the top-k logits through a sigmoid, each chosen expert run on its input times its
# score (not its output; Llama 4); external: the model routes and calls SparseMoE.mix (Gemma 4)
Router = Literal["none", "softmax_topk", "sigmoid_grouped", "topk_softmax", "sigmoid_input", "external"]
# plain: per expert gate/up/down without biases, the config's activation; gpt_oss: biased experts
# stored as [E, H, 2I] with gate and up interleaved (columns ::2 and 1::2), the clamped SwiGLU
# ((up + 1) * gate * sigmoid(alpha * gate), gate clamped above and up both sides at `swiglu_limit`)
# llama4: plain experts stored stacked input-major, [E, H, 2I] (gate half, then up half) and [E, I, H]
ExpertForm = Literal["plain", "gpt_oss", "llama4"]
# llama4: queries scaled by 1 + beta * log(1 + floor(position / original_max_position_embeddings)) after
# the rotary, beta = the rope parameters' `llama_4_scaling_beta` (Ministral 3); "none" without a beta
# temperature: on the no-rotary layers, queries times 1 + attn_scale * log1p(floor((position + 1) /
# floor_scale)) where `attn_temperature_tuning` (Llama 4's own)
QueryScale = Literal["none", "llama4", "temperature"]
# config: `attention_bias` on q, k, v and o; qkv: always on q, k, v only; config_qkv: `attention_bias`
# on q, k, v only (GLM-4.5)
BiasRule = Literal["none", "config", "qkv", "config_qkv"]


@dataclass(frozen=True)
class FamilySpec:
    """What one architecture is. Norm placement:
    - pre: x += attn(input_ln(x)); x += mlp(post_attention_ln(x))  (Llama)
    - sandwich: x += post_attention_ln(attn(input_ln(x))); x += post_feedforward_ln(mlp(pre_feedforward_ln(x)))
      (Gemma 2/3)
    - post: x += post_attention_ln(attn(x)); x += post_feedforward_ln(mlp(x))  (OLMo 2/3)
    """

    model_type: str
    norm: NormKind = "rms"
    placement: NormPlacement = "pre"
    qk_norm: QKNorm = "none"
    bias: BiasRule = "config"
    mlp_bias: bool = False  # whether the config's `mlp_bias` is read (Llama, Granite, SmolLM3)
    activation_key: str = "hidden_act"  # the config key naming the MLP activation
    window: WindowScheme = "none"
    # when config.json has no `layer_types`: every `full_every`-th layer is global, the rest slide
    # (Gemma 2: 2; Gemma 3: `sliding_window_pattern`, 6; OLMo 3: 4); 0: Qwen2's `max_window_layers` rule
    full_every: int = 0
    local_rope: bool = False  # sliding layers have their own rotary parameters (Gemma 3, OLMo 3)
    rope_theta: float = 10000.0  # the rotary base when config.json names none (the config class's default)
    local_rope_theta: float | None = None  # the sliding layers' base when named nowhere; None: rope_theta
    partial_rotary_factor: float = 1.0  # when config.json names none (GLM-4.5's config class: 0.5)
    softcap: bool = False  # attention and final logit soft-capping read from the config (Gemma 2/3)
    embed_scale: EmbedScale = "none"
    multipliers: bool = False  # Granite's residual, attention and logits multipliers
    query_pre_attn_scalar: bool = False  # attention scale = query_pre_attn_scalar ** -0.5 (Gemma)
    no_rope_layers: bool = False  # SmolLM3: `no_rope_layers[i] == 0` -> layer i has no rotary
    query_scale: QueryScale = "none"
    router: Router = "none"
    renormalize_topk: Literal["always", "config"] = "config"  # Mixtral always; Qwen3-MoE if norm_topk_prob
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert checkpoint names
    moe_module: str = "mlp"  # the checkpoint's name of the MoE block (Mixtral: block_sparse_moe)
    mlp_module: str = "mlp"  # the checkpoint's name of a dense layer's MLP (Llama 4: feed_forward)
    # the config key sizing the dense layers' MLP beside MoE layers ("": intermediate_size; Llama 4:
    # intermediate_size_mlp, its experts' size being intermediate_size)
    dense_intermediate_key: str = ""
    shared_experts: int = 0  # shared experts when the config names none (Llama 4: always one)
    # the rotary pairs dimensions (2i, 2i + 1) (Llama 4's complex rotary), not (i, i + d/2): the loader
    # permutes each q/k head's rows into the half-split order Baton rotates in (q . k is unchanged)
    rope_interleaved: bool = False
    # the config key counting the multi-token-prediction layers a checkpoint stores after the last
    # layer (GLM-4.5: num_nextn_predict_layers); Baton does not run them: their tensors are skipped by name
    mtp_layers_key: str = ""
    expert_form: ExpertForm = "plain"
    attention_sinks: bool = False  # a learned logit per head in every attention softmax (gpt-oss's `sinks`)
    # Gated DeltaNet state layers beside the attention layers, by `layer_types` ("linear_attention"):
    # "grouped": Qwen3-Next's fused in_proj_qkvz / in_proj_ba; "split": Qwen3.5's four projections.
    # Their attention layers are gated (q_proj doubled: an output gate per head) (baton.model.hybrid)
    deltanet: Literal["", "grouped", "split"] = ""
    # LFM2's gated short-convolution state layers (`layer_types` "conv", or every layer not in
    # `full_attn_idxs`) beside plain GQA attention with per-head q/k norm (baton.model.short_conv)
    short_conv: bool = False
    # Granite 4.0-H's Mamba-2 state layers (`layer_types` "mamba" / "linear_attention") beside plain
    # attention (rotary only when `position_embedding_type` is "rope"); the MLP a dense shared MLP,
    # plus routed experts when `num_local_experts` > 0 (baton.model.mamba2)
    mamba2: bool = False
    # the name prefix of multi-token-prediction tensors stored beside the model (Qwen3-Next and
    # Qwen3.5: `mtp.*`; transformers ignores them on load); Baton does not run them: skipped by name
    mtp_prefix: str = ""
    # multi-head latent attention (DeepSeek V3, baton.model.mla): q (through a low-rank q_a/q_b where
    # `q_lora_rank`), a compressed latent KV (`kv_lora_rank`) and a shared rotary key, cached as one
    # KV head; its rotary pairs (2i, 2i + 1) where the config's `rope_interleave` (reordered at load)
    mla: bool = False
    # Gemma 4 (baton.model.gemma4): head shapes per layer, K = V on full layers, KV shared by the
    # last layers, per-layer inputs, a MoE block beside the MLP; its config keys read by
    # `baton.model.gemma4_config` (the rotary per layer type, the window, caps and scales included)
    gemma4: bool = False
    display: str = ""  # how the README / error messages name it


FAMILIES: dict[str, FamilySpec] = {s.model_type: s for s in (
    FamilySpec("llama", mlp_bias=True, display="Llama 2/3.x"),
    FamilySpec("mistral", bias="none", window="all", display="Mistral"),
    FamilySpec("ministral3", bias="none", window="all", query_scale="llama4", display="Ministral 3"),
    FamilySpec("qwen2", bias="qkv", window="layer_types", display="Qwen2/2.5"),
    FamilySpec("qwen3", qk_norm="head", window="layer_types", display="Qwen3"),
    FamilySpec("qwen3_moe", qk_norm="head", window="all", router="softmax_topk", display="Qwen3-MoE"),
    FamilySpec("mixtral", bias="none", window="all", router="softmax_topk", renormalize_topk="always",
               expert_names=("w1", "w3", "w2"), moe_module="block_sparse_moe", display="Mixtral"),
    # GLM-4.5/4.6/4.7 (and -Air): shared experts, the first `first_k_dense_replace` layers dense
    FamilySpec("glm4_moe", qk_norm="config_head", bias="config_qkv", partial_rotary_factor=0.5,
               router="sigmoid_grouped", mtp_layers_key="num_nextn_predict_layers", display="GLM-4.5 MoE"),
    # DeepSeek V3 / R1: MLA, GLM-4.5's MoE (sigmoid grouped routing with a correction bias, a routed
    # scaling factor, shared experts, the first `first_k_dense_replace` layers dense) and its MTP layers
    FamilySpec("deepseek_v3", router="sigmoid_grouped", mtp_layers_key="num_nextn_predict_layers",
               mla=True, display="DeepSeek V3"),
    # gpt-oss: sliding and full layers by `layer_types`, attention sinks, biased q/k/v/o, biased router
    # and experts, YaRN (the config class's default rotary); MXFP4 experts dequantized at load
    FamilySpec("gpt_oss", window="layer_types", rope_theta=150000.0, router="topk_softmax", expert_form="gpt_oss",
               attention_sinks=True, display="gpt-oss"),
    FamilySpec("gemma2", norm="gemma", placement="sandwich", activation_key="hidden_activation",
               window="layer_types", full_every=2, softcap=True, embed_scale="sqrt_hidden", query_pre_attn_scalar=True,
               display="Gemma 2"),
    FamilySpec("gemma3_text", norm="gemma", placement="sandwich", qk_norm="head", activation_key="hidden_activation",
               window="layer_types", full_every=6, local_rope=True, rope_theta=1_000_000.0,
               local_rope_theta=10000.0, softcap=True, embed_scale="sqrt_hidden", query_pre_attn_scalar=True,
               display="Gemma 3 (text only)"),
    FamilySpec("gemma4_text", placement="sandwich", qk_norm="head", bias="none", activation_key="hidden_activation",
               gemma4=True, display="Gemma 4 (text only)"),
    FamilySpec("phi3", bias="none", window="all", display="Phi-3/3.5/4"),
    FamilySpec("olmo2", placement="post", qk_norm="full", display="OLMo 2"),
    # OLMo 3: OLMo 2's layer with sliding and full layers, each kind with its own rotary (YaRN on the
    # full layers only, in the released checkpoints)
    FamilySpec("olmo3", placement="post", qk_norm="full", window="layer_types", full_every=4, local_rope=True,
               rope_theta=500000.0, display="OLMo 3"),
    # hybrids: Gated DeltaNet layers (a fixed-size state per request) and gated full attention with
    # q/k norm and partial rotary; Qwen3-Next's MoE adds a gated shared expert
    FamilySpec("qwen3_next", norm="gemma", qk_norm="head", partial_rotary_factor=0.25, router="softmax_topk",
               deltanet="grouped", mtp_prefix="mtp.", display="Qwen3-Next"),
    FamilySpec("qwen3_5_text", norm="gemma", qk_norm="head", partial_rotary_factor=0.25, deltanet="split",
               mtp_prefix="mtp.", display="Qwen3.5 (text)"),
    # Qwen3.5-MoE: Qwen3.5's layers, every MLP sparse (top-k always renormalized) with the gated shared expert
    FamilySpec("qwen3_5_moe_text", norm="gemma", qk_norm="head", partial_rotary_factor=0.25, router="softmax_topk",
               renormalize_topk="always", deltanet="split", mtp_prefix="mtp.", display="Qwen3.5-MoE (text)"),
    # LFM2: short-conv state layers and GQA attention layers (q/k norm), its MLP sized by the
    # `block_*` keys, final norm `embedding_norm`, head tied by default
    FamilySpec("lfm2", qk_norm="head", bias="none", rope_theta=1_000_000.0, short_conv=True, display="LFM2"),
    FamilySpec("granitemoehybrid", embed_scale="embedding_multiplier", multipliers=True, router="softmax_topk",
               renormalize_topk="always", moe_module="block_sparse_moe", mamba2=True, display="Granite 4.0-H"),
    FamilySpec("granite", mlp_bias=True, embed_scale="embedding_multiplier", multipliers=True, display="Granite"),
    FamilySpec("smollm3", mlp_bias=True, window="layer_types", no_rope_layers=True, display="SmolLM3"),
    # Llama 4 text: chunked attention with L2 q/k norm on the rotary layers, every 4th layer without
    # rotary and with temperature-tuned queries; MoE (a sigmoid top-k router on the experts' input,
    # one shared expert) and dense layers by `moe_layers`
    FamilySpec("llama4_text", qk_norm="l2_config", window="chunked", rope_theta=500000.0, no_rope_layers=True,
               query_scale="temperature", router="sigmoid_input", renormalize_topk="config", expert_form="llama4",
               moe_module="feed_forward", mlp_module="feed_forward", dense_intermediate_key="intermediate_size_mlp",
               shared_experts=1, rope_interleaved=True, display="Llama 4 (text)"),
)}


@dataclass(frozen=True)
class TextOnlyForm:
    """A vision-language checkpoint served text only. Its `text_config` is the text model's config
    (a family above); its language model's tensors are the text model's, renamed by `text_prefixes`
    (the first prefix that matches); the tensors under `skipped_prefixes` (the vision tower and the
    projector into the text model) are skipped by this rule, counted and logged, never silently; any
    other tensor is refused as unknown, as in every checkpoint. Names are as the loader reads them,
    without the leading `model.`: transformers 5 writes `model.language_model.*`, `lm_head.*`,
    `model.vision_tower.*`; 4.x wrote `language_model.model.*`, `language_model.lm_head.*`,
    `vision_tower.*`."""

    model_type: str
    text_model_type: str  # when text_config names none (its config class's default)
    # text_config keys real checkpoints leave out (their config class's defaults: transformers 4.x
    # wrote only what differed from them)
    text_defaults: tuple[tuple[str, Any], ...] = ()
    # text_config keys the vision-language model's own forward does not apply (Gemma 3's head has
    # no final soft-capping)
    ignored_text_keys: tuple[str, ...] = ()
    text_prefixes: tuple[tuple[str, str], ...] = (
        ("language_model.model.", ""), ("language_model.lm_head.", "lm_head."), ("language_model.", ""))
    skipped_prefixes: tuple[str, ...] = ("vision_tower.", "multi_modal_projector.")
    skipped_what: str = "the vision tower"

    def text_name(self, name: str) -> str | None:
        """The text model's name for a checkpoint tensor; None: skipped (vision); unchanged: not
        the language model's (left for the loader to refuse as unknown)."""
        if name.startswith(self.skipped_prefixes):
            return None
        for prefix, replacement in self.text_prefixes:
            if name.startswith(prefix):
                return replacement + name[len(prefix):]
        return name


TEXT_ONLY: dict[str, TextOnlyForm] = {f.model_type: f for f in (
    # Mistral Small 3.1/3.2 (text: mistral), Ministral 3 and Mistral Large 3 (text: ministral3)
    TextOnlyForm("mistral3", text_model_type="mistral"),
    # Qwen3.5 (text: qwen3_5_text, a hybrid); transformers 5 names the vision tower `model.visual.*`
    TextOnlyForm("qwen3_5", text_model_type="qwen3_5_text", skipped_prefixes=("visual.",)),
    TextOnlyForm("qwen3_5_moe", text_model_type="qwen3_5_moe_text", skipped_prefixes=("visual.",)),
    # Llama 4 Scout / Maverick (text: llama4_text); its vision tower is `vision_model.*`
    TextOnlyForm("llama4", text_model_type="llama4_text", skipped_prefixes=("vision_model.", "multi_modal_projector.")),
    TextOnlyForm("gemma3", text_model_type="gemma3_text", ignored_text_keys=("final_logit_softcapping",),
                 text_defaults=(("vocab_size", 262208), ("hidden_size", 2304), ("intermediate_size", 9216),
                                ("num_hidden_layers", 26), ("num_attention_heads", 8), ("num_key_value_heads", 4),
                                ("head_dim", 256), ("hidden_activation", "gelu_pytorch_tanh"),
                                ("max_position_embeddings", 131072), ("rms_norm_eps", 1e-6),
                                ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
                                ("bos_token_id", 2), ("eos_token_id", 1))),
    # Gemma 4 (text: gemma4_text); transformers 5 names the towers `model.vision_tower.*`,
    # `model.audio_tower.*` and their projections into the text model `model.embed_vision.*`,
    # `model.embed_audio.*`
    TextOnlyForm("gemma4", text_model_type="gemma4_text",
                 skipped_prefixes=("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio."),
                 skipped_what="the vision and audio towers"),
)}

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def family_spec(model_type: str) -> FamilySpec:
    spec = FAMILIES.get(model_type)
    if spec is None:
        supported = ", ".join(sorted(FAMILIES))
        text_only = ", ".join(sorted(TEXT_ONLY))
        raise ValueError(f"unsupported model_type {model_type!r}; Baton runs: {supported} "
                         f"(and, text only, the vision-language {text_only})")
    return spec
