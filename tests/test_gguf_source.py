"""A converted GGUF is tied to its source by the file's content (issue 38, item 9): another file at the
same path, of the same size, is converted anew (never served with the old one's tokenizer, config or
blocks); the same file is not converted again; a record from before content keys is converted anew
from the file at hand (the default model's too, without a download).

The GGUFs are tiny Llamas written here with `gguf.GGUFWriter` (a 96-token byte-level vocabulary, one
layer of 32 wide): converting one takes a second or two, where the default model's takes a minute.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from baton.common import model_files
from baton.common.gguf_key import gguf_content_key
from baton.common.model_files import GGUF_SOURCE_FILE, gguf_source, resolve_model

HIDDEN, FFN = 32, 64


def write_tiny_gguf(path: Path, eos_token_id: int = 1, name: str | None = "tiny") -> None:
    """A one-layer Llama GGUF with float32 tensors (seeded: the same every time) and a byte-level BPE
    tokenizer; `eos_token_id` is a fixed-size header value, so the file's size does not depend on it;
    `name` is its `general.name` (None: none)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if name is not None:
        writer.add_name(name)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    tokens = ["<s>", "</s>"] + [chr(b) for b in range(33, 127)] + ["ab", "cd"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b", "c d"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(eos_token_id)
    writer.add_vocab_size(len(tokens))
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_k.weight": (HIDDEN // 2, HIDDEN), "blk.0.attn_v.weight": (HIDDEN // 2, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def converted_eos(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["eos_token_id"]


def embedding_row0(model_dir: Path) -> list[float]:
    from baton.model.loader import _read_tensors

    return _read_tensors(model_dir)["embed_tokens.weight"][0, :4].tolist()  # read from the GGUF itself


def test_a_gguf_becomes_a_directory_without_weights_read_as_transformers_reads_it(tmp_path, cache):
    """No dequantized copy on disk: the directory holds the config, tokenizer and name map, and the
    loader's tensors are transformers' own for that file, name for name and bit for bit."""
    import torch
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from baton.model.loader import _read_tensors

    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    converted = resolve_model(source)
    assert not list(converted.glob("*.safetensors")) and not list(converted.glob("*.bin"))
    assert sum(f.stat().st_size for f in converted.iterdir()) < 100_000
    ours = _read_tensors(converted)
    theirs = {n.removeprefix("model."): t for n, t in
              load_gguf_checkpoint(str(source), return_tensors=True,
                                   model_to_load=_meta_llama(converted))["tensors"].items()}
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)  # q/k rows un-permuted as transformers does
    source.unlink()  # the file is the weights: a directory whose file is gone says so
    with pytest.raises(FileNotFoundError, match="GGUF file that is gone"):
        _read_tensors(converted)


def _meta_llama(model_dir: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BATON_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_another_file_of_the_same_size_at_the_same_path_is_converted_anew(tmp_path, cache):
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, eos_token_id=1)
    converted = resolve_model(source)
    assert converted_eos(converted) == 1 and gguf_source(converted) == source.resolve()
    sentinel = converted / "sentinel"  # gone if the directory is converted again
    sentinel.touch()
    assert resolve_model(source) == converted and sentinel.exists()  # unchanged: not converted again

    size = source.stat().st_size
    write_tiny_gguf(source, eos_token_id=0)  # another tokenizer setting, in a file of the same size
    assert source.stat().st_size == size
    assert gguf_source(converted) is None  # the engine would not serve these blocks with that config
    assert resolve_model(source) == converted and not sentinel.exists()
    assert converted_eos(converted) == 0

    sentinel.touch()
    before = embedding_row0(converted)
    embedding = next(t for t in gguf.GGUFReader(source).tensors if t.name == "token_embd.weight")
    with open(source, "r+b") as f:  # other weights, same header, same size
        f.seek(embedding.data_offset)
        f.write(np.full(4, 0.5, dtype=np.float32).tobytes())
    assert source.stat().st_size == size
    assert resolve_model(source) == converted and not sentinel.exists()
    assert embedding_row0(converted) == [0.5] * 4 != before


def test_a_record_without_a_content_key_is_converted_anew_and_the_default_model_is_not_downloaded(cache, monkeypatch):
    """A cache written by an earlier Baton (path and size only) cannot tell whether its file changed:
    the default model is converted again from the GGUF the cache keeps, with no download."""
    kept = cache / "gguf" / f"{model_files.DEFAULT_MODEL_NAME}.Q4_1.gguf"
    kept.parent.mkdir(parents=True)
    write_tiny_gguf(kept, eos_token_id=0)
    converted = model_files.default_model_dir()
    converted.parent.mkdir(parents=True)
    model_files.convert_gguf(kept, converted)
    record = json.loads((converted / GGUF_SOURCE_FILE).read_text())
    assert record["key"] == gguf_content_key(kept)
    write_tiny_gguf(kept, eos_token_id=1)  # the file changed, and the record is an old one
    del record["key"]
    (converted / GGUF_SOURCE_FILE).write_text(json.dumps(record))
    assert gguf_source(converted) is None

    def no_download(*args, **kwargs):
        raise AssertionError(f"downloaded: {args}")

    monkeypatch.setattr(model_files.subprocess, "run", no_download)
    assert resolve_model(None) == converted
    assert converted_eos(converted) == 1 and gguf_source(converted) == kept.resolve()


def test_the_content_key_covers_the_header_and_both_ends_of_every_tensor(tmp_path):
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    original = source.read_bytes()
    key = gguf_content_key(source)
    assert key.startswith("gguf-header+tensor-ends-v1:")
    reader = gguf.GGUFReader(source)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    edits = {"header": 40, "first tensor's first bytes": reader.data_offset,
             "last tensor's last bytes": len(original) - 4, "last tensor's first bytes": last.data_offset}
    for where, at in edits.items():
        changed = bytearray(original)
        changed[at] ^= 0xFF
        source.write_bytes(bytes(changed))
        assert gguf_content_key(source) != key, where
    source.write_bytes(original)
    assert gguf_content_key(source) == key
    source.write_bytes(b"not a gguf" * 10)  # unparsable: keyed by all of it
    assert gguf_content_key(source).startswith("whole-file:")


def test_the_fast_reader_reads_every_field_and_tensor_as_ggufs_reader(tmp_path, default_gguf_model_dir):
    """baton.common.gguf_reader: opening a file with a Gemma-sized vocabulary took 36 s on every worker's
    start (Zen 3); its reader's fields (every part, its dtype and byte order, the indexes into them, the
    types), values and tensors are gguf.GGUFReader's, on the default model's file (a 49k-token
    vocabulary and its merges) and on one with every kind of array (bools, ints, floats, strings, empty)."""
    from baton.common.gguf_reader import FastGGUFReader

    arrays = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(arrays), "llama")
    writer.add_array("llama.flags", [True, False, True])
    writer.add_array("llama.widths", [128, 128, 256])
    writer.add_array("llama.scales", [0.5, -1.25])
    writer.add_array("llama.names", ["a", "bé", "日本", ""])
    writer.add_array("llama.none", [])
    writer.add_string("llama.text", "one")
    writer.add_uint32("llama.count", 7)
    writer.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (arrays, gguf_source(default_gguf_model_dir)):
        expected, got = gguf.GGUFReader(str(path)), FastGGUFReader(str(path))
        assert list(got.fields) == list(expected.fields)
        for key, field in expected.fields.items():
            mine = got.fields[key]
            assert (mine.offset, mine.data, mine.types, len(mine.parts)) == (field.offset, field.data, field.types,
                                                                              len(field.parts)), key
            assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(mine.parts, field.parts)), key
            assert repr(mine.contents()) == repr(field.contents()), key
        assert [(t.name, t.data_offset, t.data.tobytes()) for t in got.tensors] == \
               [(t.name, t.data_offset, t.data.tobytes()) for t in expected.tensors]
