"""The GGUF tests' files: a tiny checkpoint and its float32 and Q8_0 GGUFs, built once per family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Writer = Callable[..., Path]  # (checkpoint dir, out, tokenizer GGUF, q8_0=...) -> out


def gguf_files_once(checkpoint: Callable[[str, Path], Path], write: Writer, built: dict[str, dict[str, Path]],
                    tmp_path_factory: Any, default_gguf_model_dir: Path) -> Callable[[str], dict[str, Path]]:
    """get(family) -> {"hf": its checkpoint (`checkpoint(family, a fresh folder)`), "f32" / "q8_0": its
    GGUFs as `write` writes them, with the default model's tokenizer}; `built` keeps them."""
    from baton.common.model_files import gguf_source

    tokenizer = gguf_source(default_gguf_model_dir)
    assert tokenizer is not None

    def get(family: str) -> dict[str, Path]:
        if family not in built:
            root = tmp_path_factory.mktemp(f"gguf-{family}")
            hf_dir = checkpoint(family, root)
            built[family] = {"hf": hf_dir,
                             "f32": write(hf_dir, root / f"tiny-{family}.F32.gguf", tokenizer),
                             "q8_0": write(hf_dir, root / f"tiny-{family}.Q8_0.gguf", tokenizer, q8_0=True)}
        return built[family]

    return get


def assert_gguf_is_its_checkpoint(files: dict[str, Path], prompts: list[list[int]],
                                  rename: Callable[[str], str | None] = lambda name: name.removeprefix("model."),
                                  joined: Callable[[dict], dict] = lambda tensors: tensors) -> None:
    """The float32 GGUF's tensors, as the loader reads them, are the checkpoint's (`rename`: a checkpoint
    name as the loader's, None where the file leaves it out; `joined`: the renamed tensors as the file
    joins them, experts stacked), and it gives transformers' float32 greedy tokens of the checkpoint, batched."""
    import torch
    from safetensors.torch import load_file

    from baton import LLM
    from baton.common.model_files import resolve_model
    from baton.model.loader import _read_tensors
    from tests.test_families import greedy, hf_greedy, tokens_of

    tensors = _read_tensors(resolve_model(str(files["f32"])))
    checkpoint = {}
    for name, tensor in load_file(files["hf"] / "model.safetensors").items():
        if (renamed := rename(name)) is not None:
            checkpoint[renamed] = tensor
    checkpoint = joined(checkpoint)
    assert set(tensors) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(tensors[name], tensor.to(tensors[name].dtype)), name
    expected = [hf_greedy(files["hf"], p) for p in prompts]
    llm = LLM(model=str(files["f32"]), dtype="float32", quantization="none", num_kv_blocks=128)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
