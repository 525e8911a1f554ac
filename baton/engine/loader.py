"""Load Hugging Face safetensors weights into `LlamaModel` (fusing q/k/v and gate/up)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from baton.engine.config import ModelConfig
from baton.engine.model import LlamaModel


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


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto",
               device: torch.device | str | None = None) -> tuple[LlamaModel, ModelConfig]:
    model_dir = Path(model_dir)
    device = torch.device(device) if device is not None else default_device()
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = LlamaModel(config)
    tensors = _read_tensors(model_dir)
    state: dict[str, torch.Tensor] = {"embed_tokens.weight": tensors["embed_tokens.weight"],
                                      "norm.weight": tensors["norm.weight"]}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = tensors["lm_head.weight"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[p + norm + ".weight"] = tensors[p + norm + ".weight"]
        attn = p + "self_attn."
        state[attn + "qkv_proj.weight"] = torch.cat(
            [tensors[attn + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
        if config.attention_bias:
            state[attn + "qkv_proj.bias"] = torch.cat(
                [tensors[attn + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj")])
        state[attn + "o_proj.weight"] = tensors[attn + "o_proj.weight"]
        mlp = p + "mlp."
        state[mlp + "gate_up_proj.weight"] = torch.cat(
            [tensors[mlp + "gate_proj.weight"], tensors[mlp + "up_proj.weight"]])
        state[mlp + "down_proj.weight"] = tensors[mlp + "down_proj.weight"]
        if config.mlp_bias:
            for n in ("gate_up_proj", "down_proj"):
                src = [tensors[mlp + "gate_proj.bias"], tensors[mlp + "up_proj.bias"]] if n == "gate_up_proj" \
                    else [tensors[mlp + "down_proj.bias"]]
                state[mlp + n + ".bias"] = torch.cat(src)
    state = {k: v.to(device=device, dtype=torch_dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval()
    model.prepare()
    return model, config
