"""One copy of a GGUF's packed weights per machine (issue 42, item 3): two worker processes loading the
same GGUF map one packed file read-only (baton.model.packed_cache) instead of each repacking the blocks
into memory of its own, and answer alike.

The GGUF is a tiny Llama (tests/test_gguf_source.write_tiny_gguf's shapes) whose projections are Q8_0
blocks, so that `--quantization auto` serves them through the native int8 kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.test_families import family_dir  # noqa: F401 (a fixture)
from tests.test_gguf_source import write_tiny_gguf

PROMPT = [5, 10, 20, 30, 44, 7, 9, 8]

# The packed files this process maps (from /proc/self/smaps): their permissions, resident KB, and how
# many of those are copies of its own (Anonymous: copy-on-write pages) rather than the page cache's.
READ_MAPS = """
maps, current = {}, None
for line in open("/proc/self/smaps"):
    fields = line.split()
    if not fields[0].endswith(":"):  # a mapping's header line (a path, or none: anonymous memory)
        path = fields[5] if len(fields) >= 6 else ""
        current = path if path.endswith(".bin") and "/packed/" in path else None
        if current:
            maps.setdefault(current, {"perms": set(), "rss_kb": 0, "anonymous_kb": 0})["perms"].add(fields[1])
    elif current and fields[0] == "Rss:":
        maps[current]["rss_kb"] += int(fields[1])
    elif current and fields[0] == "Anonymous:":
        maps[current]["anonymous_kb"] += int(fields[1])
for m in maps.values():
    m["perms"] = sorted(m["perms"])
"""

# Loads the model as a worker does and reports its greedy tokens and the packed files it maps.
LOAD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from baton.llm import LLM
from baton.common.sampling_params import SamplingParams
from baton.model.linear import QuantizedLinear

llm = LLM(model=sys.argv[1], dtype="bfloat16", quantization="auto", num_kv_blocks=32, num_threads=1)
[out] = llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
model = llm.engine.runtime.model
ops = [getattr(owner, name) for owner, name, _ in model.projection_slots()]
""" + READ_MAPS + """print(json.dumps({"tokens": out.outputs[0].token_ids, "maps": maps,
                  "quantized": sum(isinstance(op, QuantizedLinear) and op.native for op in ops)}))
"""


def write_q8_0_gguf(path: Path) -> None:
    """write_tiny_gguf's model with its projections (not the embedding or norms) as Q8_0 blocks."""
    write_tiny_gguf(path)
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(path) + ".q8", "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, kind)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data, dtype=np.float32).reshape([int(x) for x in reversed(tensor.shape)])
        if tensor.name.startswith("blk.") and data.ndim == 2:
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(path) + ".q8", path)


@pytest.fixture
def kernels_or_skip():
    from baton.model import kernels

    loaded = kernels.load()
    if loaded is None or not loaded.q8_available():
        pytest.skip("no native int8 kernel on this CPU: nothing is packed, so nothing is shared")
    return loaded


def test_two_workers_map_one_packed_file_and_answer_alike(tmp_path, monkeypatch, kernels_or_skip):
    cache = tmp_path / "cache"
    monkeypatch.setenv("BATON_CACHE", str(cache))
    source = tmp_path / "tiny-q8.Q8_0.gguf"
    write_q8_0_gguf(source)
    from baton.common.model_files import resolve_model

    model_dir = resolve_model(str(source))  # converted once here: the two loads below start together
    env = {**os.environ, "BATON_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-c", LOAD, str(model_dir), json.dumps(PROMPT)]
    cwd = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results, logs = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
        logs.append(err)

    # the blocks' packs; the embedding's table (dequantized) is the other file (`shared_weights`)
    [packed_file] = [p for p in (cache / "packed").glob("*.bin") if not p.name.startswith("weights-")]
    for result in results:
        assert result["quantized"] == 4  # qkv, o, gate_up, down: the file's Q8_0 blocks, natively
        assert str(packed_file) in result["maps"]  # both map the one file ...
        mapping = result["maps"][str(packed_file)]
        assert mapping["perms"] == ["r--s"] and mapping["rss_kb"] > 0  # read-only, shared, in use ...
        assert mapping["anonymous_kb"] == 0  # ... and no page of it copied into the process
    assert results[0]["tokens"] == results[1]["tokens"]
    # one process packed and wrote, the other waited for it and only mapped
    assert sorted("written to" in log for log in logs) == [False, True]
    assert sum("mapped from" in log for log in logs) == 1

    # a third load, alone, maps the same file and answers the same
    third = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert json.loads(third.stdout.strip().splitlines()[-1])["tokens"] == results[0]["tokens"]
    assert "mapped from" in third.stderr and len(list((cache / "packed").glob("*.bin"))) == 2

    # and a worker with the shared file turned off packs its own copy, to the same tokens
    private = subprocess.run(cmd, env={**env, "BATON_PACKED_CACHE": "off"}, cwd=cwd, capture_output=True,
                             text=True, timeout=300)
    assert private.returncode == 0, private.stderr[-3000:]
    alone = json.loads(private.stdout.strip().splitlines()[-1])
    assert alone["maps"] == {} and alone["tokens"] == results[0]["tokens"]


# As LOAD, for dense weights (quantization none, the dtype in argv[3]): the native bf16 matmul's packs,
# or the float32 weights F.linear reads, and the embedding are what is shared. It reports too which
# of the model's large parameters are views of the packed file (read-only tensors).
LOAD_DENSE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from baton.llm import LLM
from baton.common.sampling_params import SamplingParams

llm = LLM(model=sys.argv[1], dtype=sys.argv[3], quantization="none", num_kv_blocks=32, num_threads=1)
[out] = llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
model = llm.engine.runtime.model
ranges = [[int(a, 16) for a in line.split()[0].split("-")] for line in open("/proc/self/maps") if "/packed/" in line]
mapped = sorted(name for name, p in model.named_parameters()
                if p.numel() and any(lo <= p.data_ptr() < hi for lo, hi in ranges))
""" + READ_MAPS + """
print(json.dumps({"tokens": out.outputs[0].token_ids, "maps": maps, "mapped": mapped}))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dense_workers_map_one_file_and_answer_alike(tmp_path, monkeypatch, dtype):
    """Dense weights (issue 42): in bf16 the native bf16 matmul's packs, in float32 (what `--dtype
    auto` loads on a CPU without bf16 instructions, AMD Zen 3; on every CPU) the weights F.linear
    reads, and the embedding table: the first load writes them to the cache, a second maps them
    read-only (no page copied) and answers the same, each of the float32 parameters a view of the
    file; with the cache off a load keeps private copies, to the same tokens."""
    from baton.model import kernels
    from baton.model.linear import native_gemv

    if dtype == "bfloat16" and not native_gemv(kernels.load()):
        pytest.skip("no native bf16 matmul on this CPU (AVX512-BF16): nothing is packed, so nothing is shared")
    cache = tmp_path / "cache"
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    env = {**os.environ, "BATON_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    from baton.common.model_files import resolve_model

    monkeypatch.setenv("BATON_CACHE", str(cache))
    model_dir = resolve_model(str(source))
    cmd = [sys.executable, "-c", LOAD_DENSE, str(model_dir), json.dumps(PROMPT), dtype]
    cwd = Path(__file__).resolve().parents[1]
    runs = [subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300) for _ in range(2)]
    results = []
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    [packed_file] = list((cache / "packed").glob("weights-*.bin"))
    assert "written to" in runs[0].stderr and "mapped from" in runs[1].stderr
    for result in results:
        mapping = result["maps"][str(packed_file)]
        assert mapping["perms"] == ["r--s"] and mapping["rss_kb"] > 0 and mapping["anonymous_kb"] == 0
        if dtype == "float32":
            # the tiny model's tensors of a page or more: the tied embedding / head, q, o, the fused
            # k|v, gate|up and down (its norms stay private)
            assert result["mapped"] == ["embed_tokens.weight", "layers.0.mlp.down_proj.weight",
                                        "layers.0.mlp.gate_up_proj.weight", "layers.0.self_attn.o_proj.weight",
                                        "layers.0.self_attn.qkv_proj.weight"]
    assert results[0]["tokens"] == results[1]["tokens"]
    private = subprocess.run(cmd, env={**env, "BATON_PACKED_CACHE": "off"}, cwd=cwd, capture_output=True,
                             text=True, timeout=300)
    assert private.returncode == 0, private.stderr[-3000:]
    alone = json.loads(private.stdout.strip().splitlines()[-1])
    assert alone["maps"] == {} and alone["mapped"] == [] and alone["tokens"] == results[0]["tokens"]


def test_a_gguf_load_reads_each_served_projection_once_and_then_never(tmp_path, monkeypatch, kernels_or_skip):
    """Issue 42 (GGUF without the detour): the projections the file's blocks serve are never loaded
    as a dequantized model. The first load reads each one once, alone, to check its repack (streamed
    into the shared file); a load that finds the file maps it and reads none of them; both serve the
    blocks natively, with the same weights."""
    from baton.common.model_files import resolve_model
    from baton.model import gguf_checkpoint
    from baton.model.runtime import RuntimeConfig, load_runtime

    monkeypatch.setenv("BATON_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny-q8.Q8_0.gguf"
    write_q8_0_gguf(source)
    model_dir = resolve_model(str(source))
    read: list[str] = []
    original = gguf_checkpoint.GGUFCheckpoint.__getitem__
    monkeypatch.setattr(gguf_checkpoint.GGUFCheckpoint, "__getitem__",
                        lambda self, name: read.append(name) or original(self, name))
    config = RuntimeConfig(model_dir, dtype="bfloat16", quantization="auto", release_load_copies=True)

    first = load_runtime(config)
    projections = sorted(n for n in read if n.endswith("_proj.weight"))
    layers = first.config.num_layers
    assert len(projections) == layers * 7 and len(set(projections)) == len(projections)  # q k v o gate up down
    assert "embed_tokens.weight" in read  # what is not served from blocks is read as before

    read.clear()
    second = load_runtime(config)
    assert [n for n in read if n.endswith("_proj.weight")] == []
    assert "embed_tokens.weight" in read
    for runtime in (first, second):
        assert runtime.quantization == "gguf"
        assert not any(p.is_meta for p in runtime.model.parameters())
    assert first.description == second.description


# As LOAD_DENSE for a MoE (quantization in argv[3], float32): which of the model's parameters, and how
# many of its native quantized packs (projections and experts' ops), are views of the packed file.
LOAD_MOE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from baton.llm import LLM
from baton.common.sampling_params import SamplingParams
from baton.model.linear import QuantizedLinear
from baton.model.moe_quant import moe_layers

llm = LLM(model=sys.argv[1], dtype="float32", quantization=sys.argv[3], num_kv_blocks=32, num_threads=1)
[out] = llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
model = llm.engine.runtime.model
ranges = [[int(a, 16) for a in line.split()[0].split("-")] for line in open("/proc/self/maps") if "/packed/" in line]
inside = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in ranges)
mapped = sorted(name for name, p in model.named_parameters() if p.numel() and inside(p))
experts = [op for moe in moe_layers(model) for pair in (moe.expert_ops or []) for op in pair]
ops = [getattr(owner, name) for owner, name, _ in model.projection_slots()] + experts
packs = [op.packed for op in ops if isinstance(op, QuantizedLinear) and op.native]
""" + READ_MAPS + """
print(json.dumps({"tokens": out.outputs[0].token_ids, "maps": maps, "mapped": mapped, "experts": len(experts),
                  "packs": len(packs), "packs_mapped": sum(inside(p) for p in packs)}))
"""


def test_a_moes_experts_are_one_copy_per_machine_dense_or_quantized(tmp_path, family_dir, kernels_or_skip):
    """A MoE's experts are most of its bytes (issue 42): under `auto` on a safetensors checkpoint the
    dense expert stacks, under int8 the experts' Q8_0 ops (and the projections' packs) are written
    once to the machine's file and mapped read-only by every worker after; the same tokens as a
    worker keeping private copies."""
    model_dir = family_dir("qwen3_moe")  # layers 0 and 2 MoE (8 experts), layer 1 dense
    env = {**os.environ, "BATON_CACHE": str(tmp_path / "cache"), "TOKENIZERS_PARALLELISM": "false"}
    cwd = Path(__file__).resolve().parents[1]

    def load(quantization: str, **extra: str) -> tuple[dict, str]:
        cmd = [sys.executable, "-c", LOAD_MOE, str(model_dir), json.dumps(PROMPT), quantization]
        run = subprocess.run(cmd, env={**env, **extra}, cwd=cwd, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr

    dense, log = load("none")
    assert "written to" in log
    assert {"layers.0.mlp.experts_gate_up", "layers.0.mlp.experts_down", "layers.2.mlp.experts_gate_up",
            "layers.2.mlp.experts_down"} <= set(dense["mapped"]), dense["mapped"]
    first, log = load("int8")
    second, log_second = load("int8")
    private, _ = load("int8", BATON_PACKED_CACHE="off")
    assert "quantized packs" in log and "written to" in log and "mapped from" in log_second
    for result in (first, second):
        assert result["experts"] == 2 * 2 * 8 and result["packs"] >= result["experts"]
        assert result["packs_mapped"] == result["packs"]
        [mapping] = [m for path, m in result["maps"].items() if "/weights-" in path and m["rss_kb"]] or [None]
        assert mapping is not None and mapping["perms"] == ["r--s"] and mapping["anonymous_kb"] == 0
    assert private["packs_mapped"] == 0 and private["maps"] == {}
    assert first["tokens"] == second["tokens"] == private["tokens"]
