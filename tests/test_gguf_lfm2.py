"""LFM2 GGUFs (llama.cpp's `lfm2`: short-conv state layers beside GQA attention). Under the default
`--quantization auto` their projections are served as the file's blocks; that named each projection
by Baton's module path, and LFM2's checkpoint calls the short conv `conv` where Baton's layer calls it
`linear_attn`, so `baton serve LFM2-1.2B-Q8_0.gguf` failed ("the GGUF has no tensor for
['model.layers.0.linear_attn.in_proj']"). The files come from tests/lfm2_gguf.py, a writer checked
against llama.cpp's converter (same keys, same tensors byte for byte)."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton import LLM
from baton.model.quant import QuantizedLinear
from tests.gguf_files import assert_gguf_is_its_checkpoint, gguf_files_once
from tests.lfm2_gguf import write_lfm2_gguf
from tests.test_families import assert_first_tokens_near_ties, prompts  # noqa: F401
from tests.test_gguf_qwen35 import hf_over_the_files_weights
from tests.test_hybrid import hybrid_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")
_BUILT: dict[str, dict[str, Path]] = {}


@pytest.fixture(scope="module")
def lfm2_gguf(hybrid_dir, tmp_path_factory, default_gguf_model_dir):  # noqa: F811
    return gguf_files_once(lambda family, _: hybrid_dir(family), write_lfm2_gguf, _BUILT, tmp_path_factory,
                           default_gguf_model_dir)("lfm2")


def test_an_lfm2_gguf_is_its_checkpoint_and_gives_its_tokens(lfm2_gguf, prompts):  # noqa: F811
    """Every tensor the checkpoint's (the conv kernel's squeezed axis restored), and transformers'
    float32 greedy tokens on the checkpoint, batched."""
    assert_gguf_is_its_checkpoint(lfm2_gguf, prompts)


def test_an_lfm2_ggufs_projections_are_served_from_its_own_blocks(lfm2_gguf, prompts, monkeypatch):  # noqa: F811
    """Q8_0 under `auto` (the default): every projection, the short conv's in/out ones included, the
    file's blocks (the load check compares each with transformers' dequantization), each prompt's
    first greedy token transformers' float32 one over the same weights but at near-ties (later
    tokens of this tiny model drift apart at bf16 rounding: transformers' own bf16 moves a logit of
    a 70-token prompt's fifth token by 1.4, 3x its row's near-tie allowance)."""
    monkeypatch.setenv("BATON_PACKED_CACHE", "off")
    llm = LLM(model=str(lfm2_gguf["q8_0"]), num_kv_blocks=128)
    names = []
    for owner, name, _ in llm.engine.runtime.model.projection_slots():
        op = getattr(owner, name)
        assert isinstance(op, QuantizedLinear) and op.scheme == "q8_0", name
        names.append(name)
    assert {"in_op", "out_op", "qkv", "gate_up", "head"} <= set(names)
    hf = hf_over_the_files_weights(lfm2_gguf)
    assert_first_tokens_near_ties(llm, hf, prompts)
