"""Which GGUF tensor each Hugging Face parameter of a model is, by transformers' own rule.

transformers maps names with `get_gguf_hf_weights_map` over the model built from its config: gguf's
table of every module name's GGUF name, applied to the model's parameter names. Building the model
(on the meta device) takes a second, so the map is made once, when a model directory is made from
the file (`model_files.convert_gguf`), and kept beside its config (NAMES_FILE); the loader reads it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

NAMES_FILE = "baton-gguf-tensors.json"
# tensors the converter renames by hand (not through gguf's table), by architecture: a layer's name -> ggml's
RENAMED = {"gemma4": {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}}
_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(?P<index>\d+)\.(?P<rest>.+)$")


def hf_to_gguf_names(reader: Any, config: Any) -> dict[str, str]:
    """{Hugging Face parameter name (`model.layers.0.self_attn.q_proj.weight`): GGUF tensor name} for
    every parameter of `config`'s causal LM that the file (`reader`, a gguf.GGUFReader) holds."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    gguf_arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), None)
    if gguf_arch is None:
        raise ValueError(f"the gguf package knows no architecture {arch!r}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    name_map = gguf.get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    present = {t.name for t in reader.tensors}
    names: dict[str, str] = {}
    for hf_name in model.state_dict():
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(module)
        if gguf_name is not None and f"{gguf_name}.{suffix}" in present:
            names[hf_name] = f"{gguf_name}.{suffix}"
        # a bare tensor of a module (Gemma 4's `layer_scalar`): the converter names it as a module's weight
        elif (gguf_name := name_map.get_name(hf_name)) is not None and f"{gguf_name}.weight" in present:
            names[hf_name] = f"{gguf_name}.weight"
        # a bare `X_bias` named as module X's bias (GLM-4.5's router `e_score_correction_bias`: `exp_probs_b.bias`)
        elif (hf_name.endswith("_bias") and (gguf_name := name_map.get_name(hf_name.removesuffix("_bias"))) is not None
              and f"{gguf_name}.bias" in present):
            names[hf_name] = f"{gguf_name}.bias"
        elif (layer := _LAYER.match(hf_name)) and (renamed := RENAMED.get(arch, {}).get(layer["rest"])):
            if f"blk.{layer['index']}.{renamed}" in present:
                names[hf_name] = f"blk.{layer['index']}.{renamed}"
    return names


def read_names(model_dir: Path) -> dict[str, str] | None:
    try:
        names = json.loads((Path(model_dir) / NAMES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return names if isinstance(names, dict) else None
