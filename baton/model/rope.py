"""Rotary position embeddings: inverse frequencies as transformers' `modeling_rope_utils` computes
them, precomputed cos/sin tables, and the rotation.

Rules: frequencies are computed in fp32 with the reference's exact expressions (a table lookup must
equal the on-the-fly value, or fp32 parity breaks); the tables are per position, so a type that
transformers switches by the *sequence's* length is made per position here:
- longrope: short factors below `original_max_position_embeddings`, long factors from there on (as
  vLLM does). transformers switches the whole sequence once it grows past that length, so the two
  agree on every position below it.
- dynamic (NTK): the base for a sequence as long as the table (at least max_position_embeddings),
  so positions within the model's context get the default frequencies, as in transformers.
Partial rotary (Phi-4-mini's partial_rotary_factor) rotates the first `rotary_dim` dims only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from baton.model.config import ModelConfig


def rotary_dim(config: ModelConfig) -> int:
    if config.kv_lora_rank:  # MLA: head_dim is the cache row's; the rotary part is its own width
        return config.qk_rope_head_dim
    return int(config.head_dim * config.partial_rotary_factor)


def _base_freq(base: float, dim: int) -> torch.Tensor:
    # [dim/2]: the reference's default inverse frequencies
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(config: ModelConfig, local: bool = False, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] and the attention scaling (applied to cos and sin).
    local: the sliding layers' parameters (Gemma 3), where the config has its own for them.
    seq_len: the sequence length the length-dependent types (dynamic, longrope) are computed for."""
    theta, scaling = config.rope_theta, config.rope_scaling
    if local and (config.rope_theta_local is not None):
        theta, scaling = config.rope_theta_local, config.rope_scaling_local
    scaling = scaling or {}
    dim = rotary_dim(config)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return _base_freq(theta, dim), 1.0
    if rope_type == "linear":
        inv_freq = _base_freq(theta, dim)
        inv_freq /= scaling["factor"]
        return inv_freq, 1.0
    if rope_type == "dynamic":
        max_pos = config.max_position_embeddings
        seq = max(seq_len or max_pos, max_pos)
        factor = scaling["factor"]
        base = theta * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_freq(base, dim), 1.0
    if rope_type == "llama3":
        return _llama3(_base_freq(theta, dim), scaling), 1.0
    if rope_type == "yarn":
        return _yarn(theta, dim, scaling, config)
    if rope_type == "longrope":
        return _longrope(theta, dim, scaling, config, seq_len)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(theta: float, dim: int, scaling: dict[str, Any], config: ModelConfig) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        attention_factor = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(theta: float, dim: int, scaling: dict[str, Any], config: ModelConfig,
              seq_len: int | None) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta**shape), float(attention_factor)


def _cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float().unsqueeze(-1) * inv_freq.float().unsqueeze(0)  # [P, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


LENGTH_DEPENDENT = ("dynamic", "longrope")  # types whose frequencies depend on the table's length


def length_dependent(config: ModelConfig, local: bool = False) -> bool:
    """Whether the rope's frequencies depend on the sequence length (then a table is computed for
    the whole context at once, as the reference computes it); the others' rows are the same
    whatever the table's length, so a table need only reach the positions in use."""
    scaling = (config.rope_scaling_local if local and config.rope_theta_local is not None else config.rope_scaling) or {}
    return scaling.get("rope_type", scaling.get("type", "default")) in LENGTH_DEPENDENT


def rope_table(config: ModelConfig, num_positions: int, dtype: torch.dtype, device: torch.device | str,
               local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for positions [0, num_positions): [P, rotary_dim] each, in `dtype`.

    Computed in fp32 as the reference does (position * inv_freq, then cos/sin), so a lookup equals
    the on-the-fly value. The sin table carries rotate_half's sign (-sin on the first half), so that
    rope(x) = x * cos + roll(x, half) * sin_signed: three ops.
    """
    positions = torch.arange(num_positions, dtype=torch.int64)
    inv_freq, scaling = rope_inv_freq(config, local, seq_len=num_positions)
    cos, sin = _cos_sin(inv_freq, scaling, positions)
    params = (config.rope_scaling_local if local and config.rope_theta_local is not None else config.rope_scaling) or {}
    if params.get("rope_type") == "longrope":
        # per position: short factors below the original context (see the module docstring)
        original = params["original_max_position_embeddings"]
        short, short_scaling = rope_inv_freq(config, local, seq_len=None)
        head = min(original, num_positions)
        cos[:head], sin[:head] = _cos_sin(short, short_scaling, positions[:head])
    half = cos.shape[-1] // 2
    sin[:, :half] = -sin[:, :half]
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, d]; cos, sin_signed: [T, 1, r] with r <= d (partial rotary: the first r dims) -> [T, heads, d]
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin_signed), x[..., r:]), dim=-1)
    if x.dtype == torch.float32:
        # the reference's rotate_half, op for op (the parity path)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        sin = torch.cat((-sin_signed[..., :half], sin_signed[..., half:]), dim=-1)
        return x * cos + rotated * sin
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
