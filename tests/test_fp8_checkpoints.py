"""Block-wise FP8 checkpoints (DeepSeek V3/R1, Qwen3 "-FP8" ...: `X.weight` in float8_e4m3fn +
`X.weight_scale_inv`, quant_method "fp8"), dequantized at load (`baton.model.fp8_blocks`).

A tiny random-init model (tests/test_families.py's) is converted to FP8 blocks here, as the released
checkpoints are: each projection weight quantized per block to e4m3 with a float32 inverse scale, the
embeddings, norms, router and head left as they are (`modules_to_not_convert`). Baton's loaded weights
equal the dequantization exactly in float32 (ours, and transformers' own: its CPU load of the FP8
checkpoint, which dequantizes, where the blocks divide the weights; its `_dequantize_fp8_weight`
where an edge block is partial, which its load refuses), and its greedy tokens equal transformers'
on the checkpoint that holds the dequantized weights. Unpaired weights and scales are refused by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from baton import LLM
from baton.model.fp8_blocks import dequantize
from baton.model.loader import load_model
from tests import test_families
from tests.test_families import _edit_checkpoint, greedy, hf_greedy, hf_model, tokens_of

family_dir, prompts = test_families.family_dir, test_families.prompts  # the fixtures, shared

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# family -> the block: Qwen3's weights (64, 32, 128 rows; 64, 128 columns) divide into 32s; DeepSeek
# V3's do not into 16s (kv_a_proj_with_mqa has 32 + 8 = 40 rows: 2.5 blocks, as the released 576 are 4.5
# blocks of 128), nor its experts' 32 columns into 16 x 24 (a partial last column)
CASES = {"qwen3": [32, 32], "deepseek_v3": [16, 24]}
NOT_CONVERTED = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"]  # DeepSeek's router, as released


def to_fp8(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [..., N, K] -> (e4m3 [..., N, K], float32 inverse scales [..., ceil(N/bn), ceil(K/bk)]),
    each block's largest magnitude mapped to e4m3's largest (partial edge blocks padded with zeros)."""
    *prefix, rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(*prefix, grid[0] * block[0], grid[1] * block[1])
    padded[..., :rows, :cols] = weight.float()
    blocks = padded.unflatten(-1, (grid[1], block[1])).unflatten(-3, (grid[0], block[0]))  # [..., R, bn, C, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R, C]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-4, -3).flatten(-2)[..., :rows, :cols].contiguous(), scale_inv


def reference(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The definition, element by element: weight[i, j] = q[i, j] * scale_inv[i // bn, j // bk]."""
    rows, cols = q.shape[-2:]
    i = torch.arange(rows) // block[0]
    j = torch.arange(cols) // block[1]
    return q.float() * scale_inv[..., i[:, None], j[None, :]]


def converted(name: str, tensor: torch.Tensor) -> bool:
    """Every matrix but those NOT_CONVERTED names (norms and biases are vectors)."""
    return tensor.dim() >= 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight", ".mlp.gate.weight"))


def fp8_and_dequantized(model_dir: Path, out: Path, block: list[int]) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """`model_dir` converted to FP8 blocks, and the checkpoint of their dequantized weights; and the
    latter's tensors by name."""
    dense: dict[str, torch.Tensor] = {}

    def to_blocks(tensors):
        for name in [n for n in tensors if converted(n, tensors[n])]:
            q, scale_inv = to_fp8(tensors[name], block)
            tensors[name] = q
            tensors[name + "_scale_inv"] = scale_inv
            dense[name] = reference(q, scale_inv, block)

    fp8 = _edit_checkpoint(model_dir, out / "fp8", to_blocks)
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block,
        "modules_to_not_convert": NOT_CONVERTED}}))
    assert dense, "nothing was converted"
    dequantized = _edit_checkpoint(model_dir, out / "dequantized", lambda tensors: tensors.update(dense))
    return fp8, dequantized, dense


@pytest.fixture(scope="module")
def checkpoints(family_dir, tmp_path_factory):
    made: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]] = {}

    def get(family: str) -> tuple[Path, Path, dict[str, torch.Tensor]]:
        if family not in made:
            made[family] = fp8_and_dequantized(family_dir(family), tmp_path_factory.mktemp(f"fp8-{family}"),
                                               CASES[family])
        return made[family]

    return get


# ------------------------------------------------------------------ the dequantization

@pytest.mark.parametrize("shape, block", [((64, 96), (32, 32)), ((40, 64), (16, 16)), ((3, 50, 70), (16, 32)),
                                          ((200, 300), (128, 128))])
def test_dequantize_is_the_block_definition_and_transformers(shape, block):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    generator = torch.Generator().manual_seed(sum(shape))
    q, scale_inv = to_fp8(torch.randn(*shape, generator=generator) * 3, list(block))
    scale_inv = scale_inv * torch.rand(scale_inv.shape, generator=generator).add(0.5)  # scales apart
    expected = reference(q, scale_inv, list(block))
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize(q, scale_inv, block, dtype)
        assert got.dtype == dtype and torch.equal(got, expected.to(dtype))
    assert torch.equal(dequantize(q, scale_inv, block, torch.float32),
                       _dequantize_fp8_weight(q, scale_inv, list(block), torch.float32))
    if all(n % b == 0 for n, b in zip(shape[-2:], block)):  # transformers' load-time op: whole blocks only
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        op = Fp8Dequantize(None)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(dequantize(q, scale_inv, block, dtype), op._dequantize_one(q, scale_inv, dtype))


def test_one_scale_a_tensor_when_the_block_is_null():
    q, _ = to_fp8(torch.randn(8, 8), [8, 8])
    scale = torch.tensor(0.37)
    assert torch.equal(dequantize(q, scale, None, torch.float32), q.float() * scale)


def test_the_view_reads_pairs_as_weights_and_ue8m0_byte_scales_as_powers_of_two():
    """The mapping the loader sees: `X.weight` dequantized, `X.weight_scale_inv` gone, the rest as is;
    DeepSeek V4-style ue8m0 scales stored as bytes are 2^(b - 127), as transformers reads them."""
    from baton.model.fp8_blocks import FP8BlocksView

    q, _ = to_fp8(torch.randn(2, 6, 5), [4, 4])  # 3D (experts), partial blocks both ways
    exponents = torch.tensor([[[120, 127], [130, 126]], [[125, 128], [127, 127]]], dtype=torch.uint8)
    norm = torch.randn(5)
    tensors = {"experts.w": q, "experts.w_scale_inv": exponents, "norm.weight": norm}
    view = FP8BlocksView(tensors, torch.float32, {"weight_block_size": [4, 4], "scale_fmt": "ue8m0"})
    assert list(view) == ["experts.w", "norm.weight"] and len(view) == 2
    assert "experts.w_scale_inv" not in view and "experts.w" in view and view["norm.weight"] is norm
    assert torch.equal(view["experts.w"], reference(q, torch.exp2(exponents.float() - 127), [4, 4]))
    with pytest.raises(KeyError):
        view["experts.w_scale_inv"]


# ------------------------------------------------------------------ a checkpoint

@pytest.mark.parametrize("family", list(CASES))
def test_an_fp8_checkpoint_loads_its_dequantized_weights(family, checkpoints):
    fp8, dequantized, dense = checkpoints(family)
    block = CASES[family]
    partial = [n for n, t in dense.items() if t.shape[-2] % block[0] or t.shape[-1] % block[1]]
    assert bool(partial) == (family == "deepseek_v3")
    from_fp8, _ = load_model(fp8, dtype="float32", device="cpu", prepare=False)
    from_dense, _ = load_model(dequantized, dtype="float32", device="cpu", prepare=False)
    expected = dict(from_dense.named_parameters())
    for name, param in from_fp8.named_parameters():
        assert torch.equal(param, expected[name]), name
    # bfloat16: the float32 product cast once, as transformers' dequantization casts it
    from_fp8_bf16, _ = load_model(fp8, dtype="bfloat16", device="cpu", prepare=False)
    for name, param in from_fp8_bf16.named_parameters():
        assert torch.equal(param, expected[name].to(param.dtype)), name


def test_transformers_loads_the_fp8_checkpoint_to_the_same_weights(checkpoints):
    """transformers on a CPU dequantizes an FP8 checkpoint at load (no FP8 kernel): the weights it
    serves are the reference ones (whole blocks: its load refuses partial ones)."""
    fp8, dequantized, _ = checkpoints("qwen3")
    theirs = dict(hf_model(fp8).named_parameters())
    ours = dict(hf_model(dequantized).named_parameters())
    assert theirs.keys() == ours.keys()
    for name, param in ours.items():
        assert torch.equal(theirs[name], param), name


@pytest.mark.parametrize("family", list(CASES))
def test_fp8_greedy_matches_transformers_on_the_dequantized_weights(family, checkpoints, prompts):
    fp8, dequantized, _ = checkpoints(family)
    expected = [hf_greedy(dequantized, p) for p in prompts]
    assert len({t for r in expected for t in r}) >= 8
    llm = LLM(model=str(fp8), dtype="float32", num_kv_blocks=128)
    assert "FP8 weights (" in llm.engine.runtime.description
    assert tokens_of(llm.generate(prompts, greedy())) == expected


def test_fp8_weights_requantize_as_a_dense_checkpoint_does(checkpoints, prompts):
    """--quantization int8 quantizes the dequantized weights: the same tokens as the dense checkpoint's."""
    fp8, dequantized, _ = checkpoints("qwen3")
    llm = LLM(model=str(fp8), dtype="float32", quantization="int8", num_kv_blocks=128)
    description = llm.engine.runtime.description
    dense = LLM(model=str(dequantized), dtype="float32", quantization="int8", num_kv_blocks=128)
    assert description.startswith(dense.engine.runtime.description) and "FP8 weights (32x32 blocks)" in description
    assert tokens_of(llm.generate(prompts, greedy())) == tokens_of(dense.generate(prompts, greedy()))


# ------------------------------------------------------------------ refused by name

def test_a_scale_without_its_weight_is_refused_by_name(checkpoints, tmp_path):
    fp8, _, _ = checkpoints("qwen3")
    bad = _edit_checkpoint(fp8, tmp_path / "orphan", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"scale\(s\) without their weight: layers\.1\.self_attn\.k_proj\.weight_scale_inv"):
        LLM(model=str(bad), dtype="float32", num_kv_blocks=16)


def test_an_fp8_weight_without_its_scale_is_refused_by_name(checkpoints, tmp_path):
    fp8, _, _ = checkpoints("qwen3")
    bad = _edit_checkpoint(fp8, tmp_path / "unscaled", lambda t: t.pop("model.layers.2.mlp.up_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"FP8 weight\(s\) without their scale \(X_scale_inv\): layers\.2\.mlp\.up_proj\.weight"):
        LLM(model=str(bad), dtype="float32", num_kv_blocks=16)


def test_a_scale_of_the_wrong_grid_is_refused_by_name(checkpoints, tmp_path):
    fp8, _, _ = checkpoints("qwen3")
    config = json.loads((fp8 / "config.json").read_text())
    bad = _edit_checkpoint(fp8, tmp_path / "grid", lambda t: None)
    config["quantization_config"]["weight_block_size"] = [16, 16]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FP8 scale layers\.0\.\S+\.weight_scale_inv is \(2, 2\), but a weight of \(64, 64\) in blocks "
                                         r"of \(16, 16\) needs \(4, 4\)"):
        load_model(bad, dtype="float32", device="cpu", prepare=False)
