"""SmolLM3, OLMo 2, OLMo 3, Granite and Ministral 3 GGUFs (baton/common/gguf_llama_like.py): transformers'
GGUF reader refused their architectures (`smollm3`, `olmo2`, `granite`, `mistral3`: "not supported yet"), so
`baton serve SmolLM3-3B-Q4_K_M.gguf` failed although each family is served from safetensors. The files
come from tests/llama_like_gguf.py, a writer checked against llama.cpp's converter (same keys, same
tensors byte for byte)."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM
from baton.model.quant import QuantizedLinear
from tests.gguf_files import assert_gguf_is_its_checkpoint, gguf_files_once
from tests.llama_like_gguf import GLM_EOM, GLM_EOT, VISION, write_llama_like_gguf
from tests.test_families import (_with_config, assert_bf16_near_ties_only, assert_first_tokens_near_ties,  # noqa: F401
                                 family_dir, prompts)
from tests.test_spec_mtp import _mtp_parts
from tests.test_gguf_qwen35 import hf_over_the_files_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# mistral3: Ministral 3 as released, a vision-language checkpoint whose GGUF holds the text model
# glm4_moe: GLM-4.5 with its multi-token-prediction layer after the last, as released (not read)
FAMILIES = ("smollm3", "olmo2", "olmo3", "granite", "mistral3", "glm4_moe")
# what each family's config must get from the file (beyond the sizes every family has)
FAMILY_KEYS = {"smollm3": ("no_rope_layers",), "olmo2": (), "olmo3": ("sliding_window", "layer_types"),
               "granite": ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"),
               "mistral3": ("rope_parameters",),
               "glm4_moe": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                            "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "n_group",
                            "topk_group", "attention_bias", "use_qk_norm", "rope_parameters")}
SIZE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
_BUILT: dict[str, dict[str, Path]] = {}


@pytest.fixture(scope="module")
def llama_like_gguf(family_dir, tmp_path_factory, default_gguf_model_dir):  # noqa: F811
    """get(family) -> {"hf": the checkpoint, "f32" / "q8_0": its GGUFs}, built once per family."""
    def checkpoint(family: str, root: Path) -> Path:
        if family == "smollm3":  # llama.cpp builds in a no-rope layer every 4th (the tiny family: every 2nd)
            return _with_config(family_dir(family), root / "every-4th", no_rope_layer_interval=4,
                                no_rope_layers=[1, 1, 1, 0])
        if family == "glm4_moe":  # GLM-4.5's MTP layer after the last (its files carry it)
            out = root / "with-mtp"
            shutil.copytree(family_dir(family), out)
            tensors = load_file(out / "model.safetensors")
            save_file({**tensors, **_mtp_parts(out)}, out / "model.safetensors", metadata={"format": "pt"})
            return out
        return family_dir(family)

    return gguf_files_once(checkpoint, write_llama_like_gguf, _BUILT, tmp_path_factory, default_gguf_model_dir)


def _as_stored(value: object) -> object:
    """A config value as the file holds it: a float as float32 (approximately the checkpoint's)."""
    return pytest.approx(value, rel=1e-7) if isinstance(value, float) else value


@pytest.mark.parametrize("family", FAMILIES)
def test_a_llama_like_gguf_is_its_checkpoint_and_gives_its_tokens(family, llama_like_gguf, prompts):  # noqa: F811
    """The family's config (not llama's), every tensor the checkpoint's (q and k un-permuted where the
    converter permuted them), and transformers' float32 greedy tokens on the checkpoint, batched."""
    from baton.common.model_files import resolve_model

    files = llama_like_gguf(family)
    model_dir = resolve_model(str(files["f32"]))
    config = json.loads((model_dir / "config.json").read_text())
    raw = json.loads((files["hf"] / "config.json").read_text())
    expected_config = raw.get("text_config", raw)
    for key in SIZE_KEYS + FAMILY_KEYS[family]:
        value = expected_config.get(key)
        if key == "rope_parameters":  # Ministral 3's YaRN; max_position_embeddings is the config's own
            value = {k: v for k, v in value.items() if k != "max_position_embeddings"}
            assert config[key] == {k: _as_stored(v) for k, v in value.items()}, key
        else:
            assert config.get(key) == _as_stored(value), key
    assert config["tie_word_embeddings"] == raw.get("tie_word_embeddings", expected_config.get("tie_word_embeddings"))

    def rename(name: str) -> str | None:
        if name.startswith(VISION) or name.startswith(f"model.layers.{expected_config['num_hidden_layers']}."):
            return None  # the vision tower, the MTP layer: not in the file, or not read
        return name.removeprefix("language_model.").replace("model.language_model.", "model.").removeprefix("model.")

    assert_gguf_is_its_checkpoint(files, prompts, rename, _stacked_experts)


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (`layers.N.mlp.experts.E.gate_proj.weight`) as the GGUF reader gives them:
    transformers 5's stacks (`gate_up_proj` [E, 2I, H], gate rows then up rows; `down_proj` [E, H, I])."""
    out, experts = {}, collections.defaultdict(dict)
    for name, tensor in tensors.items():
        parts = name.split(".")
        if len(parts) == 7 and parts[2:4] == ["mlp", "experts"]:
            experts[".".join(parts[:4])].setdefault(parts[5], {})[int(parts[4])] = tensor
        else:
            out[name] = tensor
    for prefix, kinds in experts.items():
        stack = {kind: torch.stack([by_index[e] for e in sorted(by_index)]) for kind, by_index in kinds.items()}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return out


def test_a_glm4_moe_ggufs_experts_and_projections_are_served_from_its_own_blocks(llama_like_gguf, prompts,  # noqa: F811
                                                                                 monkeypatch):
    """GLM-4.5's Q8_0 file under `auto`: every projection and every expert the file's blocks, its MTP
    layer not read, each prompt's first greedy token transformers' float32 one over the same weights
    but at near-ties (a tiny MoE's later tokens drift apart at rounding: its routing)."""
    monkeypatch.setenv("BATON_PACKED_CACHE", "off")
    files = llama_like_gguf("glm4_moe")
    llm = LLM(model=str(files["q8_0"]), num_kv_blocks=128)
    # the end of a turn and of a message end a generation, as llama.cpp counts them
    assert {GLM_EOT, GLM_EOM} < set(llm.engine.eos_token_ids)
    model = llm.engine.runtime.model
    assert len(model.layers) == 4
    for owner, name, _ in model.projection_slots():
        op = getattr(owner, name)
        assert isinstance(op, QuantizedLinear) and op.scheme == "q8_0", name
    moes = [layer.mlp for layer in model.layers[1:]]
    assert all(moe.expert_ops is not None and len(moe.expert_ops) == moe.num_experts for moe in moes)
    assert all(isinstance(op, QuantizedLinear) and op.scheme == "q8_0" for moe in moes for ops in moe.expert_ops
               for op in (ops if isinstance(ops, (list, tuple)) else [ops]))
    assert_first_tokens_near_ties(llm, hf_over_the_files_weights({"hf": files["hf"], "q8_0": files["q8_0"]}), prompts)


def test_a_smollm3_ggufs_projections_are_served_from_its_own_blocks(llama_like_gguf, prompts,  # noqa: F811
                                                                    monkeypatch):
    """Q8_0 under `auto`: every projection the file's blocks (q and k rows un-permuted as stored:
    the load check compares each repack with transformers' dequantization), the greedy tokens
    transformers' float32 ones over the same weights but at near-ties."""
    monkeypatch.setenv("BATON_PACKED_CACHE", "off")
    files = llama_like_gguf("smollm3")
    llm = LLM(model=str(files["q8_0"]), num_kv_blocks=128)
    for owner, name, _ in llm.engine.runtime.model.projection_slots():
        op = getattr(owner, name)
        assert isinstance(op, QuantizedLinear) and op.scheme == "q8_0", name
    hf = hf_over_the_files_weights({"hf": files["hf"], "q8_0": files["q8_0"]})
    assert_bf16_near_ties_only(llm, hf, prompts, "smollm3-q8_0")


def test_a_gguf_of_an_architecture_no_reader_knows_is_refused_saying_what_is_read(tmp_path):
    """transformers' "GGUF model with architecture deepseek2 is not supported yet" said neither what is
    read nor what to do: the refusal names the file's architecture, those read, and the way out."""
    import gguf
    import numpy as np

    from baton.common.model_files import resolve_model

    path = tmp_path / "GLM-4.7-Flash-Q4_K_M.gguf"  # DeepSeek V3's layout (MLA), as the converter writes it
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as refused:
        resolve_model(str(path))
    message = str(refused.value)
    assert "architecture 'deepseek2' is not read from a GGUF" in message
    assert all(arch in message for arch in ("smollm3", "olmo2", "granite", "mistral3", "glm4moe", "gemma4", "qwen35",
                                            "llama"))
    assert "Hugging Face checkpoint may be served" in message
