"""`baton serve`'s preflight: what cannot work is refused in a second or two, with one message that
names the fix, before any child starts or any weight loads; what may not fit in memory is a warning.

The serve runs use the stand-in services of tests/test_cli.py (they record every start), so "no
child started" is checked, not assumed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest
import torch

from baton.cli.preflight import (MemoryEstimate, PreflightError, check_model, context_tokens,
                                 default_prefill_kv_bytes, kv_pool_bytes, mem_available)
from baton.cli.serve import wait_until_ready
from baton.model.families import FAMILIES
from baton.model.runtime import ModelConfig
from tests.test_cli import _children_records, _free_port, _serve_args, _start_serve, _wait_for, baton_cmd
from tests.test_cli import fake_services  # noqa: F401  (a fixture: pytest finds it by its name)

GIB = 1 << 30
QUICK = 15  # seconds: the preflight reads a config and binds a socket; a model load takes far longer


@pytest.fixture
def held_port():
    """A port some other process listens on (here: the test itself)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _serve(fake: dict, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(baton_cmd("serve", *args, "--stop-timeout", "5"), cwd=fake["cwd"], env=fake["env"],
                            capture_output=True, text=True, timeout=120)
    return result, time.monotonic() - started


def _nothing_started(fake: dict, result: subprocess.CompletedProcess) -> None:
    assert _children_records(fake["logs"]) == [], "a child was started"
    assert "started " not in result.stderr and "redis: " not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


# ------------------------------------------------------------------ ports

def test_a_taken_gateway_port_stops_serve_at_once(fake_services, held_port):
    result, elapsed = _serve(fake_services, "--model", str(fake_services["model"]), "--port", str(held_port))
    assert result.returncode == 2, result.stderr
    assert elapsed < QUICK, f"took {elapsed:.1f}s"
    assert f"port {held_port} on 127.0.0.1 is in use by pid {os.getpid()} (" in result.stderr, result.stderr
    assert "pass --port N or stop it" in result.stderr
    _nothing_started(fake_services, result)


def test_a_taken_worker_metrics_port_stops_serve_at_once(fake_services, held_port):
    # --worker-metrics-port P gives the prefill worker P (taken here) and the decode worker P+1
    result, elapsed = _serve(fake_services, "--model", str(fake_services["model"]), "--port", str(_free_port()),
                             "--worker-metrics-port", str(held_port))
    assert result.returncode == 2 and elapsed < QUICK, result.stderr
    assert f"port {held_port} on 127.0.0.1 is in use" in result.stderr
    assert "pass --worker-metrics-port N or stop it" in result.stderr
    _nothing_started(fake_services, result)


# ------------------------------------------------------------------ the model

def _model_with_config(tmp_path, name: str, config: dict):
    model = tmp_path / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")
    return model


def test_an_unsupported_model_type_is_refused_before_anything_starts(fake_services, tmp_path):
    model = _model_with_config(tmp_path, "not-a-model", {"model_type": "not_a_model", "hidden_size": 64})
    result, elapsed = _serve(fake_services, "--model", str(model), "--port", str(_free_port()))
    assert result.returncode == 2 and elapsed < QUICK, result.stderr
    assert "unsupported model_type 'not_a_model'" in result.stderr
    named = result.stderr.split("Baton runs:")[1]
    assert all(model_type in named for model_type in FAMILIES), result.stderr  # every supported one
    assert "pass --model" in result.stderr
    _nothing_started(fake_services, result)


def test_a_config_missing_what_the_workers_need_is_refused(fake_services, tmp_path):
    model = _model_with_config(tmp_path, "half-a-config", {"model_type": "llama", "hidden_size": 64})
    result, elapsed = _serve(fake_services, "--model", str(model), "--port", str(_free_port()))
    assert result.returncode == 2 and elapsed < QUICK, result.stderr
    assert "its config.json has no 'num_attention_heads'" in result.stderr
    _nothing_started(fake_services, result)


def test_an_mtp_draft_without_the_layer_is_refused_before_anything_starts(fake_services, tmp_path):
    """`--speculative-config '{"method": "mtp"}'` on a checkpoint that carries no MTP layer: refused at
    once, naming what is missing and what to pass instead (not a decode worker restarted six times)."""
    from safetensors.torch import save_file

    plain = json.loads((fake_services["model"] / "config.json").read_text())
    glm = {**plain, "model_type": "glm4_moe", "num_nextn_predict_layers": 1, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1}
    cases = [(_model_with_config(tmp_path, "no-mtp", plain), "has no multi-token-prediction layers"),
             (_model_with_config(tmp_path, "mtp-declared", glm), "the checkpoint carries none (no layers.")]
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, cases[1][0] / "model.safetensors")
    for model, message in cases:
        result, elapsed = _serve(fake_services, "--model", str(model), "--port", str(_free_port()),
                                 "--speculative-config", '{"method": "mtp"}')
        assert result.returncode == 2 and elapsed < QUICK, result.stderr
        assert message in result.stderr and '{"method": "ngram"' in result.stderr, result.stderr
        _nothing_started(fake_services, result)


# ------------------------------------------------------------------ memory

def test_the_memory_estimate_warns_only_past_what_is_available():
    # 2 workers, each a copy of 1 GiB of weights and a 1 GiB KV pool: 4 GiB
    estimate = MemoryEstimate(weights_bytes=GIB, kv_pool_bytes=[GIB, GIB], available_bytes=3 * GIB)
    assert estimate.total_bytes == 4 * GIB
    warning = estimate.warning()
    assert warning is not None
    assert "2 workers may need about 4.0 GiB (2 x 1.0 GiB of weights + 2.0 GiB of KV pools)" in warning
    assert "but 3.0 GiB is available" in warning and "--kv-cache-memory" in warning
    # the fix named is the one that helps most: here the weights outweigh the pools
    heavy = MemoryEstimate(weights_bytes=8 * GIB, kv_pool_bytes=[GIB, GIB], available_bytes=3 * GIB).warning()
    assert heavy is not None and "--quantization int8 or int4" in heavy
    assert MemoryEstimate(GIB, [GIB, GIB], available_bytes=4 * GIB).warning() is None  # fits exactly
    assert MemoryEstimate(GIB, [GIB, GIB], available_bytes=None).warning() is None  # unknown: no guess


def test_weights_the_workers_map_once_are_counted_once(monkeypatch):
    """A GGUF's blocks, bf16 packs, float32 weights, embeddings, experts and int8/int4 packs are one
    copy per machine (the page cache's): 4 workers of a 1 GiB model need 1 GiB of weights, not 4;
    BATON_PACKED_CACHE=off shares nothing."""
    from baton.cli.preflight import shared_weight_bytes

    embedding = 1024 * 512 * 2
    assert shared_weight_bytes(GIB) == GIB
    monkeypatch.setenv("BATON_PACKED_CACHE", "off")
    assert shared_weight_bytes(GIB) == 0

    shared = MemoryEstimate(weights_bytes=GIB, kv_pool_bytes=[GIB] * 4, available_bytes=4 * GIB,
                            shared_bytes=GIB - embedding)
    assert shared.total_bytes == GIB + 4 * embedding - embedding + 4 * GIB
    warning = shared.warning()
    assert warning is not None and ("(1023.0 MiB of weights mapped once + 4 x 1.0 MiB per worker + 4.0 GiB "
                                    "of KV pools)") in warning, warning
    # the same workers each with their own copy: 8 GiB, and the fix named is the weights'
    private = MemoryEstimate(weights_bytes=5 * GIB, kv_pool_bytes=[GIB] * 4, available_bytes=4 * GIB).warning()
    assert private is not None and "4 x 5.0 GiB of weights" in private and "--quantization int8" in private


def test_mem_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    2048 kB\n")
    assert mem_available(meminfo) == 2048 * 1024
    assert mem_available(tmp_path / "absent") is None
    assert mem_available() is None or mem_available() > 0  # this machine's


def test_kv_pool_bytes_follow_the_flags_a_worker_gets(fake_services):
    config = ModelConfig.from_dir(fake_services["model"])  # 2 layers, 2 KV heads of 16
    # blocks x (layers x K,V x heads x block_size x head_dim x bytes)
    assert kv_pool_bytes(config, 16, "float32", "auto", 10, None) == 10 * 2 * 2 * 2 * 16 * 16 * 4
    assert kv_pool_bytes(config, 16, "bfloat16", "auto", 10, None) == 10 * 2 * 2 * 2 * 16 * 16 * 2
    # int8: a byte a value and a 4-byte scale per token and head
    assert kv_pool_bytes(config, 16, "bfloat16", "int8", 10, None) == 10 * 2 * 2 * 2 * 16 * (16 + 4)
    assert kv_pool_bytes(config, None, "float32", "auto", None, "2GiB") == 2 * GIB
    assert kv_pool_bytes(config, None, "float32", "auto", None, None) == GIB  # the workers' default
    with pytest.raises(PreflightError, match="--kv-cache-memory: not a size"):
        kv_pool_bytes(config, None, "float32", "auto", None, "lots")


def test_the_prefill_pool_default_holds_two_full_context_prompts(fake_services, tmp_path):
    config = ModelConfig.from_dir(fake_services["model"])  # fp32 KV: 2 layers x K,V x 2 heads x 16 x 4 = 512 B a token
    per_token = 2 * 2 * 2 * 16 * 4
    assert default_prefill_kv_bytes(config, 2048, 16, "float32", "auto") == 256 << 20  # 2 MiB: the floor
    assert default_prefill_kv_bytes(config, 1 << 20, 16, "float32", "auto") == 2 * (1 << 20) * per_token
    assert default_prefill_kv_bytes(config, 1 << 20, 16, "bfloat16", "auto") == (1 << 20) * per_token
    # a prompt's last partial block takes a whole block
    assert default_prefill_kv_bytes(config, (1 << 20) + 1, 16, "float32", "auto") == 2 * ((1 << 20) + 16) * per_token

    # the context: --max-model-len where given, else the model's own
    long_model = _model_with_config(tmp_path, "long", {**json.loads((fake_services["model"] / "config.json").read_text()),
                                                        "max_position_embeddings": 1 << 20})
    assert context_tokens(long_model, config, _serve_args()) == 1 << 20
    assert context_tokens(long_model, config, _serve_args("--max-model-len", "4096")) == 4096
    assert context_tokens(fake_services["model"], config, _serve_args()) == config.max_position_embeddings

    # the memory estimate counts what the prefill workers will be given
    check = check_model(long_model, _serve_args("--dtype", "float32", "--prefill-workers", "2", "--kv-cache-memory", "64MiB"))
    assert check.prefill_kv_cache_memory == "1024MiB"
    assert check.memory.kv_pool_bytes == [GIB, GIB, 64 << 20]
    given = check_model(long_model, _serve_args("--prefill-kv-cache-memory", "300MiB"))
    assert given.prefill_kv_cache_memory == "300MiB" and given.memory.kv_pool_bytes[0] == 300 << 20
    with pytest.raises(PreflightError, match="--prefill-kv-cache-memory: not a size"):
        check_model(long_model, _serve_args("--prefill-kv-cache-memory", "lots"))


def test_serve_gives_each_prefill_worker_its_own_pool_size(fake_services):
    """The default, sized to the context asked for, reaches the prefill worker's config; the decode
    worker keeps --kv-cache-memory."""
    proc, out, err = _start_serve(fake_services, "--max-model-len", str(1 << 19), "--kv-cache-memory", "64MiB")
    try:
        assert _wait_for(lambda: any("Baton is serving" in line for line in out) or proc.poll() is not None, 60), err
        assert proc.poll() is None, "".join(err)
        config = {r["argv"][0].split(os.sep)[-2]: r["config"] for r in _children_records(fake_services["logs"])}
        # 2 prompts x 2^19 tokens x 512 B (--dtype auto counts as fp32)
        assert config["prefill_worker"]["kv_cache_memory"] == 512 << 20
        assert config["decode_worker"]["kv_cache_memory"] == 64 << 20
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_serve_warns_when_the_workers_may_not_fit_and_serves_anyway(fake_services):
    proc, out, err = _start_serve(fake_services, "--kv-cache-memory", "900TiB")
    try:
        assert _wait_for(lambda: any("Baton is serving" in line for line in out) or proc.poll() is not None, 60), err
        assert proc.poll() is None, "".join(err)
        warning = next(line for line in err if "warning: 2 workers may need about" in line)
        assert "of KV pools) but" in warning and "pass a smaller --kv-cache-memory" in warning
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0


# ------------------------------------------------------------------ progress while waiting

class _QuietSupervisor:
    """Enough of a Supervisor for wait_until_ready: no children, the log kept."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def check(self) -> None:
        pass

    def log(self, line: str) -> None:
        self.lines.append(line)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def test_waiting_for_readiness_says_so_every_few_seconds():
    sup = _QuietSupervisor()
    with pytest.raises(TimeoutError, match="still waiting for the gateway"):
        # nothing listens on this port: the gateway never answers
        wait_until_ready(sup, "127.0.0.1", _free_port(), timeout=2.2, progress_every=0.5)  # type: ignore[arg-type]
    assert sup.lines[0] == "waiting for the gateway ..."
    progress = [line for line in sup.lines[1:] if line.startswith("waiting for the gateway ... (")]
    assert len(progress) >= 2 and progress[-1].endswith("s)"), sup.lines


def test_an_fp8_checkpoint_is_estimated_at_the_width_it_is_served_in(tmp_path):
    """FP8 weights are one byte each on disk but dequantized at load (baton.model.fp8_blocks): the
    memory estimate counts them at --dtype's width (int8 / int4: the packs'), other tensors as stored."""
    import torch
    from safetensors.torch import save_file

    from baton.cli.preflight import served_weight_bytes

    path = tmp_path / "model.safetensors"
    save_file({"layers.0.mlp.down_proj.weight": torch.zeros(64, 128, dtype=torch.float8_e4m3fn),
               "layers.0.mlp.down_proj.weight_scale_inv": torch.ones(2, 4),
               "norm.weight": torch.ones(64, dtype=torch.bfloat16)}, str(path))
    on_disk, fp8 = path.stat().st_size, 64 * 128
    assert served_weight_bytes([path], "bfloat16", "none") == on_disk + fp8
    assert served_weight_bytes([path], "float32", "auto") == on_disk + 3 * fp8
    assert served_weight_bytes([path], "bfloat16", "int8") == on_disk + fp8 // 4
    plain = tmp_path / "plain.safetensors"
    save_file({"norm.weight": torch.ones(64, dtype=torch.bfloat16)}, str(plain))
    assert served_weight_bytes([plain], "bfloat16", "none") == plain.stat().st_size  # as stored
    empty = tmp_path / "empty.safetensors"  # no header (the workers' load says what is wrong): as stored
    empty.write_bytes(b"")
    assert served_weight_bytes([empty], "bfloat16", "none") == 0
