"""Model families as small declarative specs, read by one model (`baton.model.model`).

Rules of this file:
- A `FamilySpec` says what a family's *architecture* is (which norms and where, q/k norm, biases,
  which window scheme, how the embedding is scaled, the MoE router, how its checkpoint names its
  tensors); the numbers (sizes, eps, theta, windows, multipliers) come from each checkpoint's
  `config.json` (`ModelConfig.from_dir`). No family-specific branch lives in the model: it reads
  the fields of `ModelConfig` that `from_dir` derives from the spec.
- Every detail follows transformers' own modeling file for that family
  (transformers/models/<family>/modeling_<family>.py), which is the parity oracle of the tests.
- A model_type missing here is refused by `from_dir`, naming the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NormKind = Literal["rms", "gemma"]  # gemma: x_hat * (1 + w), the weight stored as an offset from 1
NormPlacement = Literal["pre", "sandwich", "post"]
QKNorm = Literal["none", "head", "full"]  # head: over head_dim per head; full: over the whole projection
WindowScheme = Literal["none", "all", "layer_types"]
EmbedScale = Literal["none", "sqrt_hidden", "embedding_multiplier"]
Router = Literal["none", "softmax_topk"]
BiasRule = Literal["none", "config", "qkv"]  # config: `attention_bias` on q, k, v and o; qkv: on q, k, v only


@dataclass(frozen=True)
class FamilySpec:
    """What one architecture is. Norm placement:
    - pre: x += attn(input_ln(x)); x += mlp(post_attention_ln(x))  (Llama)
    - sandwich: x += post_attention_ln(attn(input_ln(x))); x += post_feedforward_ln(mlp(pre_feedforward_ln(x)))
      (Gemma 2/3)
    - post: x += post_attention_ln(attn(x)); x += post_feedforward_ln(mlp(x))  (OLMo 2)
    """

    model_type: str
    norm: NormKind = "rms"
    placement: NormPlacement = "pre"
    qk_norm: QKNorm = "none"
    bias: BiasRule = "config"
    mlp_bias: bool = False  # whether the config's `mlp_bias` is read (Llama, Granite, SmolLM3)
    activation_key: str = "hidden_act"  # the config key naming the MLP activation
    window: WindowScheme = "none"
    local_rope: bool = False  # sliding layers have their own rotary parameters (Gemma 3)
    softcap: bool = False  # attention and final logit soft-capping read from the config (Gemma 2/3)
    embed_scale: EmbedScale = "none"
    multipliers: bool = False  # Granite's residual, attention and logits multipliers
    query_pre_attn_scalar: bool = False  # attention scale = query_pre_attn_scalar ** -0.5 (Gemma)
    no_rope_layers: bool = False  # SmolLM3: `no_rope_layers[i] == 0` -> layer i has no rotary
    router: Router = "none"
    renormalize_topk: Literal["always", "config"] = "config"  # Mixtral always; Qwen3-MoE if norm_topk_prob
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert checkpoint names
    moe_module: str = "mlp"  # the checkpoint's name of the MoE block (Mixtral: block_sparse_moe)
    display: str = ""  # how the README / error messages name it


FAMILIES: dict[str, FamilySpec] = {s.model_type: s for s in (
    FamilySpec("llama", mlp_bias=True, display="Llama 2/3.x"),
    FamilySpec("mistral", bias="none", window="all", display="Mistral"),
    FamilySpec("qwen2", bias="qkv", window="layer_types", display="Qwen2/2.5"),
    FamilySpec("qwen3", qk_norm="head", window="layer_types", display="Qwen3"),
    FamilySpec("qwen3_moe", qk_norm="head", window="all", router="softmax_topk", display="Qwen3-MoE"),
    FamilySpec("mixtral", bias="none", window="all", router="softmax_topk", renormalize_topk="always",
               expert_names=("w1", "w3", "w2"), moe_module="block_sparse_moe", display="Mixtral"),
    FamilySpec("gemma2", norm="gemma", placement="sandwich", activation_key="hidden_activation",
               window="layer_types", softcap=True, embed_scale="sqrt_hidden", query_pre_attn_scalar=True,
               display="Gemma 2"),
    FamilySpec("gemma3_text", norm="gemma", placement="sandwich", qk_norm="head", activation_key="hidden_activation",
               window="layer_types", local_rope=True, softcap=True, embed_scale="sqrt_hidden",
               query_pre_attn_scalar=True, display="Gemma 3 (text only)"),
    FamilySpec("phi3", bias="none", window="all", display="Phi-3/3.5/4"),
    FamilySpec("olmo2", placement="post", qk_norm="full", display="OLMo 2"),
    FamilySpec("granite", mlp_bias=True, embed_scale="embedding_multiplier", multipliers=True, display="Granite"),
    FamilySpec("smollm3", mlp_bias=True, window="layer_types", no_rope_layers=True, display="SmolLM3"),
)}

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def family_spec(model_type: str) -> FamilySpec:
    spec = FAMILIES.get(model_type)
    if spec is None:
        supported = ", ".join(sorted(FAMILIES))
        hint = " (Gemma 3 is served text only: use a gemma3_text checkpoint)" if model_type == "gemma3" else ""
        raise ValueError(f"unsupported model_type {model_type!r}{hint}; Baton runs: {supported}")
    return spec
