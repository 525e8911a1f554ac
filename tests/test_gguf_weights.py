"""A GGUF's blocks served as they are (issue 23): unpacked exactly as the `gguf` package dequantizes
them, mapped to the model's projections with a check that catches a wrong mapping, and tied to the
converted directory by a source record."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from baton.common.gguf_key import gguf_content_key
from baton.common.model_files import GGUF_SOURCE_FILE, gguf_source
from baton.model.gguf_embeddings import GGUFRowsEmbedding
from baton.model.gguf_weights import _check, unpack_q4, unpack_q8_0
from baton.model.linear import dequantize_q4, dequantize_q8_0


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random raw rows of a GGUF type whose fp16 scale fields hold sane values (random bytes there
    would be NaNs and infinities): any bit pattern is a valid block otherwise."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scale_fields = {"Q8_0": 1, "Q4_0": 1, "Q4_1": 2, "Q4_K": 2}[type_name]  # leading fp16 fields
    scales = rng.uniform(-0.05, 0.05, size=(n, k // block, scale_fields)).astype(np.float16)
    raw[..., : 2 * scale_fields] = scales.view(np.uint8).reshape(n, k // block, 2 * scale_fields)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_unpacked_blocks_dequantize_as_the_gguf_package_does(type_name):
    n, k = 7, 512
    raw = random_blocks(type_name, n, k, seed=len(type_name))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32))
    if type_name == "Q8_0":
        q, d = unpack_q8_0(raw, n, k)
        mine = dequantize_q8_0(q, d)
        assert torch.equal(mine, expected.reshape(n, k))  # exact: the same int8 values and fp16 scales
    else:
        q, d, m = unpack_q4(raw, type_name, n, k)
        assert q.dtype == torch.uint8 and int(q.max()) <= 15
        mine = dequantize_q4(q, d, m)
        # Q4_0 and Q4_1 exactly; Q4_K's sub-block scale (d * sc) and offset are rounded to fp16
        atol = 0.0 if type_name != "Q4_K" else 2.0 ** -10 * float(expected.abs().max())
        assert torch.allclose(mine, expected.reshape(n, k), rtol=0, atol=atol)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "F16"])
def test_a_token_table_served_as_the_files_rows_looks_up_the_loaders_values(type_name):
    """A GGUF's token table read per lookup from its rows (no copy of the table): each id's row the
    `gguf` package's dequantization of it, rounded to the model's dtype, as the loader would hold it;
    an id past the table an IndexError as nn.Embedding's."""
    n, k = 9, 256
    if type_name == "F16":
        raw = np.random.default_rng(3).standard_normal((n, k)).astype(np.float16)
    else:
        raw = random_blocks(type_name, n, k, seed=5)
    qtype = gguf.GGMLQuantizationType[type_name]
    table = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(n, k)
    for dtype in (torch.float32, torch.bfloat16):
        embedding = GGUFRowsEmbedding(raw, qtype, n, k, dtype)
        ids = torch.tensor([8, 0, 3, 3, 8])
        assert torch.equal(embedding(ids), table[ids].to(dtype))
        assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, k)
    with pytest.raises(IndexError):
        embedding(torch.tensor([n]))


def test_a_wrongly_mapped_tensor_is_an_error_at_load():
    raw = random_blocks("Q4_1", 64, 64, seed=3)
    q, d, m = unpack_q4(raw, "Q4_1", 64, 64)
    loaded = dequantize_q4(q, d, m).bfloat16()
    _check((q, d, m), "q4", loaded, "blk.0.attn_q")  # the right rows: no error
    swapped = torch.cat([loaded[32:], loaded[:32]])  # e.g. q rows left permuted for llama.cpp's RoPE
    with pytest.raises(ValueError, match="mapped wrongly"):
        _check((q, d, m), "q4", swapped, "blk.0.attn_q")


def test_a_converted_directory_knows_its_gguf_while_the_file_is_unchanged(tmp_path):
    source = tmp_path / "model.Q4_0.gguf"
    source.write_bytes(b"GGUF" + bytes(60))
    converted = tmp_path / "converted"
    converted.mkdir()
    assert gguf_source(converted) is None  # not converted from a GGUF
    record = {"path": str(source), "size": 64, "key": gguf_content_key(source)}
    (converted / GGUF_SOURCE_FILE).write_text(json.dumps(record))
    assert gguf_source(converted) == source
    source.write_bytes(b"GGUF" + bytes(100))  # replaced by another file: its blocks are not these weights
    assert gguf_source(converted) is None
    (converted / GGUF_SOURCE_FILE).write_text("{not json")
    assert gguf_source(converted) is None


def test_auto_serves_a_gguf_dequantized_where_no_native_kernel_multiplies_its_blocks(tmp_path):
    """Without AVX512-VNNI or AVX2 the blocks would be dequantized per call: auto keeps the loaded weights."""
    from types import SimpleNamespace

    from baton.model.quant import quantize_model

    class NoVNNI:
        @staticmethod
        def q8_available() -> bool:
            return False

    model = SimpleNamespace(norm=SimpleNamespace(weight=torch.empty(1)))
    source = tmp_path / "m.gguf"
    assert quantize_model(model, "auto", kernels=NoVNNI(), gguf_source=source) == "none"
    assert quantize_model(model, "auto", kernels=NoVNNI(), gguf_source=None) == "none"
    assert quantize_model(model, "none", kernels=NoVNNI(), gguf_source=source) == "none"


def test_auto_dtype_is_bf16_wherever_the_native_kernel_serves_quantized_weights(tmp_path):
    """On a CPU without bf16 instructions (AVX2) `--dtype auto` would load fp32, the torch path; with
    quantized weights the native bf16 layer path runs them twice as fast, so auto loads bf16 there."""
    from baton.model.quant import auto_dtype

    class Kernels:
        def __init__(self, available: bool) -> None:
            self.available = available

        def q8_available(self) -> bool:
            return self.available

    cpu, cuda, source = torch.device("cpu"), torch.device("cuda"), tmp_path / "m.gguf"
    native, none = Kernels(True), Kernels(False)
    assert auto_dtype("auto", source, cpu, native) == "bfloat16"  # a GGUF's own blocks
    assert auto_dtype("int8", None, cpu, native) == "bfloat16"
    assert auto_dtype("int4", None, cpu, native) == "bfloat16"
    assert auto_dtype("auto", None, cpu, native) == "auto"  # not quantized: the CPU decides
    assert auto_dtype("none", source, cpu, native) == "auto"
    assert auto_dtype("auto", source, cpu, none) == "auto"  # dequantized: as without quantization
    assert auto_dtype("int8", None, cuda, native) == "auto"
