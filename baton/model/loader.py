"""Load Hugging Face safetensors weights into the model (`baton.model.model`), by the family's names.

Rules: every parameter of the model has a recipe (`_recipes`): the checkpoint tensors it is made
of, concatenated (q|k|v and gate|up, fused as the model runs them) or stacked (MoE experts), with
the alternatives families use (Phi-3 stores qkv_proj and gate_up_proj already fused; transformers 5
may store experts as 3D tensors). Loading is strict both ways: a ValueError names every checkpoint
tensor no recipe used (an unknown tensor means an architecture feature Baton would silently drop)
and every tensor a recipe needed but did not find. The LM head of a tied checkpoint may be present
or not, and rotary caches some old checkpoints carry (`rotary_emb.inv_freq`) are not weights.
Tensors a named rule says the model does not run (a vision-language checkpoint's vision tower, GLM's
multi-token-prediction layers: `_checkpoint_view`) are skipped and counted in the log. MXFP4
weights (gpt-oss's experts: `X_blocks` + `X_scales`) are read as `X`, dequantized to the model's dtype
(`baton.model.mxfp4`), or, with `mxfp4_as_q8_0`, repacked without loss as Q8_0 expert ops
(`baton.model.mxfp4_experts`). Block-wise FP8 weights (`X.weight` + `X.weight_scale_inv`: DeepSeek V3,
*-FP8 checkpoints) are dequantized to the model's dtype as they are read (`baton.model.fp8_blocks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from baton.common.model_files import GGUF_SOURCE_FILE, gguf_source
from baton.model.config import ModelConfig
from baton.model.families import TEXT_ONLY, family_spec
from baton.model.gguf_checkpoint import GGUFCheckpoint
from baton.model.gemma4 import Gemma4LM, gemma4_recipes, shared_layers_kv_weights
from baton.model.hybrid import HybridModel, hybrid_recipes
from baton.model.mla import LatentAttention, LatentAttentionLM, half_split_rows
from baton.model.model import MLP, Attention, CausalLM
from baton.model.mtp import VOCAB_PARAMETERS, MtpHybridLM, MtpLM, MtpTensors, mtp_config, mtp_prefix
from baton.model.fp8_blocks import fp8_view
from baton.model.mxfp4 import DequantizedView, has_packed
from baton.model.mxfp4_experts import install_expert_blocks, take_expert_blocks

logger = logging.getLogger("baton.model.loader")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: bf16 where it is fast (CUDA, and CPUs with AMX/AVX-512 bf16), else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("float32", "fp32"):
        return torch.float32
    if dtype in ("bfloat16", "bf16"):
        return torch.bfloat16
    if dtype in ("float16", "fp16", "half"):
        return torch.float16
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def _cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _read_tensors(model_dir: Path) -> Mapping[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        source = gguf_source(model_dir)
        if source is not None:  # made from a GGUF: its tensors are read from the file itself
            return GGUFCheckpoint(source, model_dir)
        if (model_dir / GGUF_SOURCE_FILE).is_file():
            raise FileNotFoundError(f"{model_dir} was made from a GGUF file that is gone or changed since "
                                    f"(see {GGUF_SOURCE_FILE}); give the .gguf path again to read it anew")
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors


class _RenamedTensors(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors under the model's names (`names`: model name -> checkpoint name),
    read on access (a GGUF checkpoint dequantizes only what is asked for)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: dict[str, str]) -> None:
        self.tensors, self.names = tensors, names

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.names[name]]

    def expert_slice(self, name: str, expert: int) -> torch.Tensor | None:
        slicer = getattr(self.tensors, "expert_slice", None)
        return slicer(self.names[name], expert) if slicer is not None else None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _layer_of(name: str) -> int | None:
    parts = name.split(".", 2)
    return int(parts[1]) if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() else None


def _checkpoint_view(tensors: Mapping[str, torch.Tensor], config: ModelConfig,
                     keep_mtp: bool = False) -> Mapping[str, torch.Tensor]:
    """The tensors the model is made of, for a checkpoint that holds more by a named rule: a
    vision-language checkpoint served text only (`families.TEXT_ONLY`: its language model's tensors
    renamed, its vision tower's skipped), the multi-token-prediction layers stored after the last
    layer (GLM-4.5's `num_nextn_predict_layers`; Baton does not run them), Gemma 4's KV-shared layers'
    K/V projections and norms (never run: transformers ignores them too). Every skip is counted and
    logged; every other tensor goes on to the strict check. `keep_mtp`: the MTP layers are kept (the
    MTP head's load, baton.model.mtp, picks them out)."""
    form = TEXT_ONLY.get(config.text_only_of)
    mtp = range(config.num_layers, config.num_layers + config.mtp_layers) if not keep_mtp else range(0)
    mtp_prefix = family_spec(config.model_type).mtp_prefix if not keep_mtp else ""
    unused_kv = shared_layers_kv_weights(config)
    if form is None and not mtp and not mtp_prefix and not unused_kv:
        return tensors
    names: dict[str, str] = {}
    skipped: dict[str, int] = {}
    for name in tensors:
        model_name = form.text_name(name) if form is not None else name
        if model_name is None:
            what = form.skipped_what if form is not None else ""
        elif _layer_of(model_name) in mtp or (mtp_prefix and model_name.startswith(mtp_prefix)):
            what = "the multi-token-prediction layers"
        elif unused_kv and model_name.startswith(unused_kv):
            what = "the KV-shared layers' K/V weights"
        else:
            names[model_name] = name
            continue
        skipped[what] = skipped.get(what, 0) + 1
    for what, count in skipped.items():
        logger.info("%s: skipping %s: %d tensors", config.model_id, what, count)
    return _RenamedTensors(tensors, names)


@dataclass
class _Recipe:
    """One model parameter from checkpoint tensors: each alternative is a list of parts, each part a
    list of names concatenated along dim 0; several parts are stacked (experts), one part is the
    parameter. The first alternative found whole is used."""

    alternatives: list[list[list[str]]]
    # the joined tensor into the model's layout (gpt-oss's experts: transposed, gate/up de-interleaved)
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def names(self, alternative: int) -> list[str]:
        return [n for part in self.alternatives[alternative] for n in part]


def _recipes(model: CausalLM, config: ModelConfig) -> dict[str, _Recipe]:
    spec = family_spec(config.model_type)
    if isinstance(model, Gemma4LM):  # fused q|k|v of per-layer shapes (baton.model.gemma4)
        return {name: _Recipe(alts) for name, alts in gemma4_recipes(model, config).items()}
    if isinstance(model, HybridModel):  # state layers beside attention: its own names (baton.model.hybrid)
        return {name: _Recipe(alts) for name, alts in hybrid_recipes(model, config, spec.expert_names).items()}
    out: dict[str, _Recipe] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        out[name] = _Recipe([[[name]]])  # by default the checkpoint's name is the model's
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        attn = p + "self_attn."
        to_half_split = (lambda t: _half_split_qk(t, config)) if config.rope_interleaved else None
        if config.kv_lora_rank:  # MLA: the checkpoint's own names, rotary rows reordered (baton.model.mla)
            out.update(_mla_recipes(attn, config))
        # MLA has no fused q|k|v
        qkv_kinds = () if config.kv_lora_rank else ("weight", "bias") if config.attention_bias else ("weight",)
        for kind in qkv_kinds:
            out[f"{attn}qkv_proj.{kind}"] = _Recipe([[[f"{attn}qkv_proj.{kind}"]],
                                                     [[f"{attn}{n}_proj.{kind}" for n in "qkv"]]], to_half_split)
        mlp = p + "mlp."
        if isinstance(layer.mlp, MLP):
            dense = p + spec.mlp_module + "."  # the checkpoint's name (Llama 4: feed_forward)
            for kind in ("weight", "bias") if config.mlp_bias else ("weight",):
                out[f"{mlp}gate_up_proj.{kind}"] = _Recipe([[[f"{dense}gate_up_proj.{kind}"]],
                                                            [[f"{dense}gate_proj.{kind}", f"{dense}up_proj.{kind}"]]])
                out[f"{mlp}down_proj.{kind}"] = _Recipe([[[f"{dense}down_proj.{kind}"]]])
            continue
        if config.expert_form == "gpt_oss":
            out.update(_gpt_oss_moe_recipes(mlp))
            continue
        if config.expert_form == "llama4":
            out.update(_llama4_moe_recipes(mlp, p + spec.moe_module + "."))
            continue
        gate_name, up_name, down_name = spec.expert_names
        moe = p + spec.moe_module + "."
        experts = range(config.num_experts)
        out[f"{mlp}gate.weight"] = _Recipe([[[f"{moe}gate.weight"]]])
        if config.router == "sigmoid_grouped":
            out[f"{mlp}score_correction_bias"] = _Recipe([[[f"{moe}gate.e_score_correction_bias"]]])
        if config.num_shared_experts:
            shared = f"{moe}shared_experts."
            out[f"{mlp}shared_experts.gate_up_proj.weight"] = _Recipe([[[f"{shared}gate_proj.weight",
                                                                          f"{shared}up_proj.weight"]]])
            out[f"{mlp}shared_experts.down_proj.weight"] = _Recipe([[[f"{shared}down_proj.weight"]]])
        out[f"{mlp}experts_gate_up"] = _Recipe([
            [[f"{moe}experts.gate_up_proj"]],  # transformers 5's stacked form: [E, 2I, H]
            [[f"{moe}experts.{e}.{gate_name}.weight", f"{moe}experts.{e}.{up_name}.weight"] for e in experts]])
        out[f"{mlp}experts_down"] = _Recipe([
            [[f"{moe}experts.down_proj"]],
            [[f"{moe}experts.{e}.{down_name}.weight"] for e in experts]])
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # it is embed_tokens.weight
    return out


def checkpoint_names(model: CausalLM, config: ModelConfig) -> dict[str, list[list[list[str]]]]:
    """Per model parameter, the checkpoint tensors (without `model.`) its recipe reads: alternatives of
    parts of names (`_Recipe`). Other readers of the same files (GGUF blocks served as stored:
    `baton.model.gguf_weights`) name a parameter's sources by it, so a family's spelling lives here once."""
    return {name: recipe.alternatives for name, recipe in _recipes(model, config).items()}


def _mla_recipes(attn: str, config: ModelConfig) -> dict[str, _Recipe]:
    """MLA's projections whose rows carry the rotary part, reordered from DeepSeek's interleaved
    pairs to Baton's half-split ones where the config's `rope_interleave` (the rest load by name)."""
    if not config.rope_interleaved:
        return {}
    qk_head, rope = config.qk_nope_head_dim + config.qk_rope_head_dim, config.qk_rope_head_dim
    q_name = f"{attn}q_b_proj.weight" if config.q_lora_rank else f"{attn}q_proj.weight"
    out = {q_name: _Recipe([[[q_name]]], lambda t: half_split_rows(t, qk_head, rope))}
    for kind in ("weight", "bias") if config.attention_bias else ("weight",):
        name = f"{attn}kv_a_proj_with_mqa.{kind}"
        out[name] = _Recipe([[[name]]], lambda t: half_split_rows(t, config.kv_lora_rank + rope, rope))
    return out


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    # [..., 2I] gate and up interleaved (gate at ::2, up at 1::2) -> [..., 2I] gate, then up
    return torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)


def _half_split_qk(qkv: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """q|k|v rows (weight or bias) with each q and k head's rows reordered from the interleaved
    rotary pairs (2i, 2i + 1) (Llama 4's complex rotary) to the half-split pairs (i, i + d/2) Baton
    rotates: row 2i goes to i, row 2i + 1 to i + d/2. The same permutation of q's and k's head
    dimensions leaves every q . k (and the weightless q/k norm) unchanged."""
    d = config.head_dim
    qk_rows = (config.num_heads + config.num_kv_heads) * d
    qk = qkv[:qk_rows].reshape(-1, d // 2, 2, *qkv.shape[1:])  # [heads, pair, 2, ...]
    qk = qk.transpose(1, 2).reshape(qk_rows, *qkv.shape[1:])
    return torch.cat([qk, qkv[qk_rows:]])


def _llama4_moe_recipes(mlp: str, moe: str) -> dict[str, _Recipe]:
    """Llama 4's MoE block (transformers' Llama4TextMoe): `router`, one `shared_expert` and stacked
    experts stored input-major, [E, H, 2I] (gate half, then up half) and [E, I, H]."""
    shared = f"{moe}shared_expert."
    return {
        f"{mlp}gate.weight": _Recipe([[[f"{moe}router.weight"]]]),
        f"{mlp}shared_experts.gate_up_proj.weight": _Recipe([[[f"{shared}gate_proj.weight",
                                                               f"{shared}up_proj.weight"]]]),
        f"{mlp}shared_experts.down_proj.weight": _Recipe([[[f"{shared}down_proj.weight"]]]),
        f"{mlp}experts_gate_up": _Recipe([[[f"{moe}experts.gate_up_proj"]]], lambda t: t.transpose(1, 2).contiguous()),
        f"{mlp}experts_down": _Recipe([[[f"{moe}experts.down_proj"]]], lambda t: t.transpose(1, 2).contiguous()),
    }


def _gpt_oss_moe_recipes(mlp: str) -> dict[str, _Recipe]:
    """gpt-oss's MoE block (transformers' GptOssMLP): `router` (weight and bias) and stacked experts
    stored input-major, [E, H, 2I] with gate/up interleaved and [E, I, H], each with a bias."""
    experts = f"{mlp}experts."
    return {
        f"{mlp}gate.weight": _Recipe([[[f"{mlp}router.weight"]]]),
        f"{mlp}gate.bias": _Recipe([[[f"{mlp}router.bias"]]]),
        f"{mlp}experts_gate_up": _Recipe([[[f"{experts}gate_up_proj"]]],
                                         lambda t: _deinterleave(t).transpose(1, 2).contiguous()),
        f"{mlp}experts_gate_up_bias": _Recipe([[[f"{experts}gate_up_proj_bias"]]], _deinterleave),
        f"{mlp}experts_down": _Recipe([[[f"{experts}down_proj"]]], lambda t: t.transpose(1, 2).contiguous()),
        f"{mlp}experts_down_bias": _Recipe([[[f"{experts}down_proj_bias"]]]),
    }


class UnreadWeights:
    """Parameters the load left unread, on the meta device (`load_model_deferring`): the projections
    a GGUF's blocks will serve (`baton.model.gguf_weights`), each read only if and when it is asked
    for (to check a repack against it), one at a time, so that loading never holds the dequantized
    model beside its packs."""

    def __init__(self, recipes: dict[str, _Recipe], tensors: Mapping[str, torch.Tensor],
                 convert: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        self._recipes, self._tensors, self._convert = recipes, tensors, convert

    def read(self, target: str) -> torch.Tensor:
        """The parameter `target` (a model parameter name) as the load would have made it."""
        recipe = self._recipes[target]
        return self._convert(target, _join(recipe, self._found(recipe), self._tensors))

    def _found(self, recipe: _Recipe) -> int:
        """The recipe's alternative the checkpoint holds whole (the load checked there is one)."""
        return next(a for a in range(len(recipe.alternatives)) if all(n in self._tensors for n in recipe.names(a)))

    def read_expert(self, target: str, expert: int) -> torch.Tensor:
        """`read(target)[expert]` for a stacked expert parameter, reading only that expert where the
        checkpoint can (a GGUF's blocks: `expert_slice`), so that checking a few sampled experts never
        holds a layer's whole dense stack."""
        recipe = self._recipes[target]
        parts = recipe.alternatives[self._found(recipe)]
        slicer = getattr(self._tensors, "expert_slice", None)
        if len(parts) == 1 and len(parts[0]) == 1 and recipe.transform is None and slicer is not None:
            one = slicer(parts[0][0], expert)
            if one is not None:
                return self._convert(target, one)
        if len(parts) > 1 and recipe.transform is None:  # stacked from per-expert tensors: join that one
            part = parts[expert]
            return self._convert(target, self._tensors[part[0]] if len(part) == 1
                                 else torch.cat([self._tensors[n] for n in part]))
        return self.read(target)[expert]


def _join(recipe: _Recipe, alternative: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    parts = recipe.alternatives[alternative]
    joined = [tensors[part[0]] if len(part) == 1 else torch.cat([tensors[n] for n in part]) for part in parts]
    tensor = joined[0] if len(joined) == 1 else torch.stack(joined)
    return recipe.transform(tensor) if recipe.transform is not None else tensor


def _build_state(recipes: dict[str, _Recipe], tensors: Mapping[str, torch.Tensor], tie_word_embeddings: bool,
                 convert: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t,
                 unread: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Each model parameter from its checkpoint tensors, passed through `convert` (with the
    parameter's name) as soon as it is joined (so a fused projection's concatenation is freed
    before the next one is made). The parameters in `unread` are checked present but not read."""
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for target, recipe in recipes.items():
        found = next((a for a in range(len(recipe.alternatives)) if all(n in tensors for n in recipe.names(a))), None)
        if found is None:
            # name what is missing from the alternative closest to complete
            best = max(range(len(recipe.alternatives)), key=lambda a: sum(n in tensors for n in recipe.names(a)))
            missing += [n for n in recipe.names(best) if n not in tensors]
            continue
        used.update(recipe.names(found))
        if target not in unread:
            state[target] = convert(target, _join(recipe, found, tensors))
    unused = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq")
                    and not (tie_word_embeddings and n == "lm_head.weight"))
    if missing or unused:
        lines = []
        if unused:
            lines.append(f"{len(unused)} checkpoint tensor(s) this model does not use: {', '.join(unused)}")
        if missing:
            lines.append(f"{len(missing)} tensor(s) the model needs but the checkpoint lacks: {', '.join(missing)}")
        raise ValueError("checkpoint does not match the model; " + "; ".join(lines))
    return state


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: torch.device | str | None = None,
               prepare: bool = True, mxfp4_as_q8_0: bool = False, kernels: Any = None) -> tuple[CausalLM, ModelConfig]:
    """The model of `model_dir` with its weights, `prepare()`d unless `prepare` is False (the
    engine prepares it itself, knowing whether its projections will be quantized). `mxfp4_as_q8_0`
    (CPU only): MXFP4 experts become Q8_0 ops on `kernels` (the native module, or None: dequantized
    per call) instead of dense weights (`baton.model.moe_quant.repacks_mxfp4_experts` decides)."""
    model, config, _ = load_model_deferring(model_dir, dtype, device, prepare=prepare, mxfp4_as_q8_0=mxfp4_as_q8_0,
                                            kernels=kernels)
    return model, config


def load_model_deferring(model_dir: str | Path, dtype: str | torch.dtype = "auto",
                         device: torch.device | str | None = None, prepare: bool = True,
                         defer: Callable[[CausalLM], set[str]] | None = None,
                         mxfp4_as_q8_0: bool = False, kernels: Any = None, mtp: bool = False,
                         ) -> tuple[CausalLM, ModelConfig, UnreadWeights | None]:
    """`load_model`, leaving the parameters `defer(model)` names (called on the model before any weight
    is read) on the meta device, readable later through the returned `UnreadWeights`. `mtp`: the
    checkpoint's multi-token-prediction layer as a one-layer model instead (baton.model.mtp)."""
    model_dir = Path(model_dir)
    device = torch.device(device) if device is not None else default_device()
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, device)
    if mtp:
        if gguf_source(model_dir) is not None:
            raise ValueError(f"{model_dir.name}: speculative_config method \"mtp\" reads the MTP layer from "
                             "safetensors; from a GGUF it is not served yet")
        prefix, config = mtp_prefix(config), mtp_config(config)
        # a vision-language checkpoint's language model renamed, its MTP layer kept
        viewed: Mapping[str, torch.Tensor] = MtpTensors(_checkpoint_view(_read_tensors(model_dir), config, keep_mtp=True),
                                                        prefix, config.model_id)
    else:
        viewed = _checkpoint_view(_read_tensors(model_dir), config)
    # FP8 block checkpoints (DeepSeek V3, *-FP8): each weight dequantized to the dtype as it is read
    tensors = fp8_view(viewed, model_dir, torch_dtype)
    raw = tensors  # MXFP4 experts served as Q8_0 are repacked from its blocks
    if has_packed(tensors):
        tensors = DequantizedView(tensors, torch_dtype)
    if config.text_only_of:
        # whose tie flag governs moved between transformers 4 (the text model's) and 5 (the outer
        # config's, True by default, but not tied where the checkpoint has its own head): the head
        # is tied exactly when the checkpoint has none, as transformers 5 ends up doing
        config.tie_word_embeddings = "lm_head.weight" not in tensors
    with torch.device("meta"):
        model = ((MtpHybridLM(config) if config.deltanet else MtpLM(config, LatentAttention if config.kv_lora_rank
                                                                      else Attention)) if mtp
                 else HybridModel(config) if config.has_state_layers else Gemma4LM(config) if config.gemma4
                 else LatentAttentionLM(config) if config.kv_lora_rank else CausalLM(config))
    # a MoE's router where the reference keeps it in fp32 (GLM-4.5's) stays fp32
    fp32 = {f"layers.{i}.mlp.{name}" for i, layer in enumerate(model.layers)
            for name in getattr(layer.mlp, "fp32_parameters", lambda: ())()}
    # copy=True: a tensor already in the target dtype would otherwise stay a view of the
    # checkpoint's memory map, and one view (a norm's weight) keeps the whole mapped file resident
    # for the worker's life (measured: 2.36 GB of a 1B model's file after load, on top of the packs).
    # Converted one parameter at a time: loading peaks at one copy plus the mapped file's pages (all
    # at once, the concatenations and the converted copies were alive together: 1.7 copies).
    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.float32 if name in fp32 else torch_dtype, copy=True)

    recipes = _recipes(model, config)
    if mtp:  # the head embeds and scores with the target's tables (MtpHead.borrow_vocab): none loaded
        for name in VOCAB_PARAMETERS:
            recipes.pop(name, None)
    taken: dict[str, str] = {}  # MXFP4 experts left to `install_expert_blocks`
    if mxfp4_as_q8_0 and device.type == "cpu":
        taken, tensors = take_expert_blocks(recipes, tensors)
    deferred = frozenset(defer(model) if defer is not None else ()) & recipes.keys()
    state = _build_state(recipes, tensors, config.tie_word_embeddings, convert, deferred)
    unread = UnreadWeights({t: recipes[t] for t in deferred}, tensors, convert) if deferred else None
    assert not (deferred and prepare), "a model with unread weights cannot be prepared yet"
    del tensors
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")
               and m not in deferred and m not in taken and not (mtp and m in VOCAB_PARAMETERS)]
    if mtp:  # empty, in the dtype and on the device (what the rotary tables and the plan read of them)
        for module in (model.embed_tokens, model.lm_head):
            module.weight = torch.nn.Parameter(torch.empty(0, config.hidden_size, dtype=torch_dtype, device=device),
                                               requires_grad=False)
    if missing or unexpected:  # a recipe bug, not a checkpoint problem
        raise ValueError(f"loaded state does not match the model: missing {missing}, unexpected {unexpected}")
    if taken:
        install_expert_blocks(model, taken, raw, kernels)
    del raw
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval()
    if prepare:
        model.prepare()
    return model, config, unread
