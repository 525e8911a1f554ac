"""The `baton` command: model fetch, the thread budget, and serve's supervision (with stand-ins).

The supervision tests run `baton serve` against stand-in gateway / worker modules put first on
PYTHONPATH, so they exercise the real supervisor (start order, readiness, signals, a child dying,
no orphans) without the real services.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from baton.cli.serve import ThreadPlan, add_serve_arguments, build_child_specs, plan_threads, probe_host
from baton.common.service_config import SERVICE_CONFIG_ENV
from baton.worker.args import parse_worker_config
from baton.worker.config import WorkerConfig

VENV_BIN = Path(sys.executable).parent
BATON = str(VENV_BIN / "baton") if (VENV_BIN / "baton").exists() else None


def baton_cmd(*args: str) -> list[str]:
    return [BATON, *args] if BATON else [sys.executable, "-m", "baton.cli.cli", *args]


# ------------------------------------------------------------------ model fetch

def test_model_fetch_twice_prints_same_cached_dir():
    first = subprocess.run(baton_cmd("model", "fetch"), capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file()
    # the weights: read from its GGUF (or, converted by an earlier Baton, dequantized beside it)
    assert (path / "baton-gguf-source.json").is_file() or list(path.glob("*.safetensors"))

    started = time.monotonic()
    second = subprocess.run(baton_cmd("model", "fetch"), capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip().splitlines()[-1] == str(path)
    assert "already in the cache" in second.stderr
    assert "converting" not in second.stderr and "downloading" not in second.stderr
    assert elapsed < 30, f"cached fetch took {elapsed:.1f}s"


def test_bench_serve_takes_vllm_flags():
    result = subprocess.run(baton_cmd("bench", "serve", "--help"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for flag in ("--base-url", "--request-rate", "--max-concurrency", "--num-prompts", "--goodput",
                 "--save-result", "--tokenizer", "--seed"):
        assert flag in result.stdout


# ------------------------------------------------------------------ thread budget

@pytest.mark.parametrize(
    "cpus, p, d, expect_p, expect_d",
    [
        (2, 1, 1, [1], [1]),
        (1, 1, 1, [1], [1]),
        (4, 1, 1, [2], [2]),
        (3, 1, 1, [2], [1]),
        (16, 1, 1, [8], [8]),
        (8, 1, 2, [3], [3, 2]),
        (8, 2, 4, [2, 2], [1, 1, 1, 1]),
        (2, 1, 3, [1], [1, 1, 1]),
    ],
)
def test_plan_threads(cpus, p, d, expect_p, expect_d):
    plan = plan_threads(cpus, p, d)
    assert plan.prefill == expect_p and plan.decode == expect_d
    assert all(t >= 1 for t in plan.prefill + plan.decode)
    if p + d <= cpus:
        assert plan.total <= cpus and plan.warning is None
    else:
        assert plan.warning and "oversubscribed" in plan.warning


def test_plan_threads_never_exceeds_cores_when_it_can():
    for cpus in range(1, 65):
        for p in range(1, 5):
            for d in range(1, 5):
                plan = plan_threads(cpus, p, d)
                # All cores are used when there are enough of them; else one thread per worker.
                assert plan.total == (cpus if cpus >= p + d else p + d)


def test_plan_threads_explicit_and_invalid():
    plan = plan_threads(2, 1, 1, threads_per_worker=2)
    assert plan.prefill == [2] and plan.decode == [2] and "oversubscribed" in plan.warning
    assert plan_threads(8, 1, 1, threads_per_worker=2).warning is None
    with pytest.raises(ValueError):
        plan_threads(2, 0, 1)
    with pytest.raises(ValueError):
        plan_threads(2, 1, 1, threads_per_worker=0)


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def child_config(spec):
    """What a child of `baton serve` reads at start, as the real one reads it (from its environment)."""
    from gateway.__main__ import load_settings

    if spec.role == "gateway":
        return load_settings([], environ=spec.env)
    return parse_worker_config(spec.role, [], environ=spec.env)


def test_each_child_gets_its_config_from_the_flags():
    args = _serve_args("--host", "0.0.0.0", "--port", "8123", "--dtype", "bfloat16", "--quantization", "int8",
                       "--kv-cache-dtype", "fp8", "--max-concurrent-requests", "64", "--max-queue-wait", "2.5", "--api-key", "k",
                       "--num-kv-blocks", "512", "--scheduler-policy", "no-evict",
                       "--max-num-batched-tokens", "256", "--block-size", "32",
                       "--worker-metrics-port", "9100", "--decode-workers", "2",
                       "--log-format", "json", "--shutdown-grace", "12",
                       "--max-embedding-tokens", "4096", "--pooling-step-tokens", "32",
                       "--responses-max-bytes", "1MiB")
    plan = ThreadPlan([2], [1, 1], cpus=4)
    specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", plan, python="py")
    assert [s.name for s in specs] == ["prefill_worker[0]", "decode_worker[0]", "decode_worker[1]", "gateway"]
    # no flags: the whole config travels in one variable
    assert [s.argv for s in specs] == [["py", "-m", m] for m in ("prefill_worker", "decode_worker", "decode_worker",
                                                                 "gateway")]
    pre, dec0, dec1, gw = (child_config(s) for s in specs)
    defaults = WorkerConfig.from_args(_worker_defaults("decode"))

    assert pre.threads == 2 and dec0.threads == 1
    assert pre.max_num_batched_tokens == 256 and pre.num_kv_blocks is None
    assert dec0.max_num_batched_tokens == defaults.max_num_batched_tokens  # the prefill workers' budget only
    assert (pre.metrics_port, dec0.metrics_port, dec1.metrics_port) == (9100, 9101, 9102)
    assert dec0.num_kv_blocks == 512 and dec0.scheduler_policy == "no-evict"
    assert pre.scheduler_policy == defaults.scheduler_policy
    assert dec0.block_size == 32 and pre.block_size == 32
    assert {c.dtype for c in (pre, dec0, dec1)} == {"bfloat16"}
    assert {c.quantization for c in (pre, dec0, dec1)} == {"int8"}
    assert {c.kv_cache_dtype for c in (pre, dec0, dec1)} == {"fp8"}
    assert pre.pooling_step_tokens == 32 and dec0.pooling_step_tokens is None
    assert pre.drain_timeout == defaults.drain_timeout  # what serve does not set: the worker's own default
    assert gw.port == 8123 and gw.host == "0.0.0.0" and gw.max_concurrent_requests == 64
    assert gw.max_queue_wait == 2.5 and gw.shutdown_grace == 12 and gw.max_embedding_tokens == 4096
    assert gw.responses_max_bytes == 1 << 20
    assert gw.max_input_tokens == gw.max_total_tokens - 1  # not given: the gateway derives it
    for config in (pre, dec0, dec1, gw):
        assert str(getattr(config, "model_dir", None) or config.model) == "/m"
        assert config.log_format == "json"  # every process logs the same way
    assert specs[0].env["OMP_NUM_THREADS"] == "2" and specs[1].env["OMP_NUM_THREADS"] == "1"


def test_serve_parses_each_gateway_flag_as_the_gateway_does():
    """Their values go into the gateway's Settings as they are: a size must be bytes, not its text."""
    from baton.cli.child_configs import GATEWAY_FLAGS
    from gateway.flags import build_parser

    gateway = {action.dest: action.type or str for action in build_parser()._actions}
    for flag, parse, _help in GATEWAY_FLAGS:
        assert gateway[flag[2:].replace("-", "_")] is parse, flag


def _worker_defaults(kind: str) -> argparse.Namespace:
    from baton.worker.args import worker_parser

    return worker_parser(kind).parse_args([])


def test_the_children_configs_round_trip_through_json():
    """A serve-built worker config and gateway Settings come back from their JSON equal; the secrets
    are not in it, but where they travel; the gateway's identity is each process's own."""
    import dataclasses

    from gateway.config import Settings

    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = _serve_args("--speculative-config", spec, "--kv-cache-memory", "2GiB", "--api-key", "k3y",
                       "--served-model-name", "a", "b", "--chat-template", "{{ messages }}", "--no-normalize")
    url = "redis://:pw@127.0.0.1:1/0"
    specs = build_child_specs(args, Path("/m"), url, ThreadPlan([1], [1], cpus=2), python="py", core_share_fd=None)
    decode = WorkerConfig.from_json(specs[1].env[SERVICE_CONFIG_ENV], redis_url=url)
    assert WorkerConfig.from_json(decode.to_json(), redis_url=url) == decode
    assert decode.speculative_config.num_speculative_tokens == 3 and decode.kv_cache_memory == 2 << 30
    prefill = child_config(specs[0])
    assert WorkerConfig.from_json(prefill.to_json(), redis_url=url) == prefill and prefill.redis_url == url
    gateway = child_config(specs[-1])
    assert gateway.api_key == "k3y" and gateway.redis_url == url
    again = Settings.from_json(gateway.to_json(), redis_url=url, api_key="k3y")
    assert dataclasses.replace(again, gateway_id=gateway.gateway_id) == gateway
    assert again.gateway_id != gateway.gateway_id  # a restarted gateway is a new one
    assert gateway.served_model_names == ("a", "b") and gateway.chat_template == "{{ messages }}"
    assert gateway.normalize is False
    for spec_ in specs:
        assert "pw" not in spec_.env[SERVICE_CONFIG_ENV] and "k3y" not in spec_.env[SERVICE_CONFIG_ENV]


def test_the_children_defaults_take_baton_variables_but_not_one_process_identity(monkeypatch):
    """As when the children parsed their own flags: BATON_MAX_NUM_SEQS reaches every worker, but
    BATON_WORKER_ID or BATON_METRICS_PORT set for `baton serve` would give all of them the same one."""
    monkeypatch.setenv("BATON_WORKER_ID", "same-for-all")
    monkeypatch.setenv("BATON_METRICS_PORT", "9999")
    monkeypatch.setenv("BATON_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("BATON_EVENT_TIMEOUT", "12.5")
    specs = build_child_specs(_serve_args(), Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1, 1], cpus=3),
                              python="py")
    workers = [child_config(spec) for spec in specs[:-1]]
    assert {(w.worker_id, w.metrics_port, w.max_num_seqs) for w in workers} == {(None, None, 7)}
    assert child_config(specs[-1]).event_timeout == 12.5


def test_a_child_reads_its_config_from_the_environment_and_refuses_flags_beside_it():
    import dataclasses

    from gateway.__main__ import load_settings

    config = dataclasses.replace(WorkerConfig.from_args(_worker_defaults("decode")), model="/m",
                                 redis_url="redis://r:1/0")
    environ = {SERVICE_CONFIG_ENV: config.to_json(), "REDIS_URL": "redis://r:1/0"}
    assert parse_worker_config("decode", [], environ=environ) == config
    with pytest.raises(SystemExit):  # the config is whole: a flag beside it is a usage error
        parse_worker_config("decode", ["--threads", "2"], environ=environ)
    with pytest.raises(SystemExit):  # and so is a setting no worker has
        parse_worker_config("decode", [], environ={SERVICE_CONFIG_ENV: '{"no_such_setting": 1}'})
    # without it, the flags as always
    assert parse_worker_config("decode", ["--threads", "3"], environ={}).threads == 3
    with pytest.raises(ValueError, match="no flags are taken"):
        load_settings(["--port", "1"], environ={SERVICE_CONFIG_ENV: "{}"})


def test_the_prefill_kv_pool_flag_reaches_the_prefill_workers_only():
    """--prefill-kv-cache-memory is each prefill worker's KV pool; --kv-cache-memory stays the decode
    workers' (a prefill worker given the decode pool's size would hold it all privately)."""
    args = _serve_args("--prefill-kv-cache-memory", "512MiB", "--kv-cache-memory", "2GiB", "--prefill-workers", "2")
    specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1, 1], [1], cpus=3), python="py")
    pre0, pre1, dec, _gw = (child_config(s) for s in specs)
    assert pre0.kv_cache_memory == pre1.kv_cache_memory == 512 << 20
    assert dec.kv_cache_memory == 2 << 30
    # neither given (build_child_specs alone: `baton serve` fills in the prefill default first)
    plain = build_child_specs(_serve_args(), Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2),
                              python="py")
    default = _worker_defaults("decode").kv_cache_memory
    assert [child_config(s).kv_cache_memory for s in plain[:2]] == [default, default]


def test_served_model_names_and_strict_api_reach_the_gateway(monkeypatch):
    args = _serve_args("--served-model-name", "a", "b/c", "--strict-api")
    specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2), python="py")
    settings = child_config(specs[-1])
    assert settings.served_model_names == ("a", "b/c") and settings.model_name == "a"
    assert settings.strict_api is True
    monkeypatch.delenv("BATON_STRICT_API", raising=False)
    plain = build_child_specs(_serve_args(), Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2),
                              python="py")
    settings = child_config(plain[-1])
    assert settings.served_model_names == ("m",) and settings.strict_api is False


def test_child_secrets_travel_in_the_environment_not_on_argv():
    # argv is world-readable (`ps`, /proc/<pid>/cmdline); the services read REDIS_URL and
    # BATON_API_KEY from their environment by default.
    url = "redis://:s3cret-pw@127.0.0.1:1/0"
    args = _serve_args("--api-key", "k3y-value", "--decode-workers", "2")
    specs = build_child_specs(args, Path("/m"), url, ThreadPlan([1], [1, 1], cpus=4), python="py")
    for spec in specs:
        text = " ".join(spec.argv) + spec.env[SERVICE_CONFIG_ENV]
        assert "s3cret-pw" not in text and "k3y-value" not in text, spec.argv
        assert spec.env["REDIS_URL"] == url
        assert spec.env.get("BATON_API_KEY") == ("k3y-value" if spec.role == "gateway" else None)


def test_serve_takes_the_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("BATON_API_KEY", "from-env")
    assert _serve_args().api_key == "from-env"
    assert _serve_args("--api-key", "flag").api_key == "flag"


def test_vllm_command_lines_parse(monkeypatch):
    """Flags a vLLM user brings: the gateway takes --enable-auto-tool-choice (tool_choice auto is
    always on) and the decode worker --kv-cache-memory-bytes (vLLM's name for --kv-cache-memory)."""
    from baton.worker.args import add_common_args
    from gateway.__main__ import parse_args

    monkeypatch.setattr("baton.common.model_files.resolve_model", lambda model: Path("/m"))
    with_flag = parse_args(["--model", "/m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    without = parse_args(["--model", "/m", "--tool-call-parser", "hermes"])
    assert with_flag.tool_call_parser == "hermes"
    # a no-op: the gateway is configured exactly as without it
    assert {**vars(with_flag), "gateway_id": ""} == {**vars(without), "gateway_id": ""}

    parser = argparse.ArgumentParser()
    add_common_args(parser, "decode")
    assert parser.parse_args(["--kv-cache-memory-bytes", "2147483648"]).kv_cache_memory == 2 << 30
    assert parser.parse_args(["--kv-cache-memory-bytes", "2GiB"]).kv_cache_memory == 2 << 30
    assert parser.parse_args(["--kv-cache-memory", "512MiB"]).kv_cache_memory == 512 << 20


def test_baton_plan_prints_each_step_kinds_path_and_one_copy_of_the_weights(tiny_model_dir, capsys):
    """`baton plan`: what prepare() chose on this machine, the bytes held once a worker freed the
    load-time copies (the tied embedding is read from the head's pack: no table beside it)."""
    from baton.cli.cli import main

    assert main(["plan", "--model", str(tiny_model_dir), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "decode-only step:" in out and "prefill step:" in out
    assert "head     x1   torch F.linear (torch.float32)" in out
    # the forward-path choices of its RuntimeConfig (BATON_* defaults: baton/model/runtime_env.py)
    assert "batch invariance: " in out and "native kernels: on" in out and "Triton attention: off" in out
    held = float(out.split("weights held in all: ")[1].split(" MiB")[0])
    params = json.loads((tiny_model_dir / "config.json").read_text())
    embedding_mib = params["vocab_size"] * params["hidden_size"] * 4 / (1 << 20)
    assert embedding_mib < held < 2 * embedding_mib  # fp32 and tied: the table once, not twice


def test_probe_host():
    assert probe_host("0.0.0.0") == "127.0.0.1"
    assert probe_host("::") == "[::1]"
    assert probe_host("127.0.0.1") == "127.0.0.1"


# ------------------------------------------------------------------ supervision with stand-ins

FAKE_SERVICE = r'''
import argparse, json, os, signal, sys, threading, time
import msgpack, redis
from baton.common import heartbeats

KIND = {kind!r}
# as the real services: the whole config in BATON_SERVICE_CONFIG, the secrets in their own variables
config = json.loads(os.environ["BATON_SERVICE_CONFIG"])
with open(os.path.join(os.environ["FAKE_LOG_DIR"], f"{{KIND}}-{{os.getpid()}}.json"), "w") as f:
    json.dump({{"argv": sys.argv, "pid": os.getpid(), "env_redis": os.environ.get("REDIS_URL"),
               "env_api_key": os.environ.get("BATON_API_KEY"), "config": config,
               "omp": os.environ.get("OMP_NUM_THREADS")}}, f)
client = redis.Redis.from_url(os.environ["REDIS_URL"])
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
die_after = float(os.environ.get("FAKE_DIE_" + KIND.upper(), "0") or 0)
started = time.monotonic()
if KIND == "gateway":
    from http.server import BaseHTTPRequestHandler, HTTPServer
    class H(BaseHTTPRequestHandler):
        def answer(self, code, body):
            self.send_response(code); self.end_headers(); self.wfile.write(json.dumps(body).encode())
        def do_GET(self):
            key = os.environ.get("BATON_API_KEY")
            if self.path in ("/info", "/stats") and key and self.headers.get("Authorization") != f"Bearer {{key}}":
                return self.answer(401, {{}})  # as the real gateway: these need the key
            if self.path == "/info":
                return self.answer(200, {{"max_total_tokens": 512}})
            if self.path == "/stats":  # the real shape: each live process's heartbeat, by kind
                workers = {{}}
                for name, value in heartbeats.live_sync(client):
                    workers.setdefault(name.decode().split(":")[2], []).append(msgpack.unpackb(value))
                return self.answer(200, {{"workers": workers}})
            if self.path != "/ready":
                self.send_response(200 if self.path == "/health" else 404); self.end_headers(); return
            # as the real /ready: 503 naming what is missing until a prefill and a decode worker beat
            kinds = {{key.decode().split(":")[2] for key, _ in heartbeats.live_sync(client)}}
            missing = [f"a live {{k}} worker" for k in ("prefill", "decode") if k not in kinds]
            self.send_response(503 if missing else 200); self.end_headers()
            self.wfile.write(json.dumps({{"missing": missing}}).encode())
        def log_message(self, *a): pass
    server = HTTPServer((config["host"], config["port"]), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
# a decode worker's heartbeat carries its KV pool, as the real one's does
beat = {{"num_kv_blocks_total": 100, "block_size": 16}} if KIND == "decode" else {{}}
while True:
    pipe = client.pipeline()
    heartbeats.queue_beat(pipe, KIND, str(os.getpid()), beat, 3)
    pipe.execute()
    if die_after and time.monotonic() - started > die_after:
        sys.exit(3)
    time.sleep(0.2)
'''


@pytest.fixture
def fake_services(tmp_path):
    """Stand-in gateway/prefill/decode packages and a stand-in model directory."""
    pkgs = tmp_path / "pkgs"
    for module, kind in (("gateway", "gateway"), ("prefill_worker", "prefill"), ("decode_worker", "decode")):
        (pkgs / module).mkdir(parents=True)
        (pkgs / module / "__init__.py").write_text("")
        (pkgs / module / "__main__.py").write_text(FAKE_SERVICE.format(kind=kind))
    model = tmp_path / "model"
    model.mkdir()
    # a config the preflight accepts (a tiny Llama); the stand-ins never read the weights
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    (model / "model.safetensors").write_bytes(b"")
    logs = tmp_path / "logs"
    logs.mkdir()
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    env["PYTHONPATH"] = os.pathsep.join([str(pkgs), *filter(None, [env.get("PYTHONPATH")])])
    env["FAKE_LOG_DIR"] = str(logs)
    return {"model": model, "logs": logs, "env": env, "cwd": tmp_path}


def _free_port() -> int:
    from baton.cli.redis_server import free_port

    return free_port()


def _start_serve(fake, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, list[str], list[str]]:
    proc = subprocess.Popen(
        baton_cmd("serve", "--model", str(fake["model"]), "--port", str(_free_port()),
                  "--stop-timeout", "5", *extra),
        cwd=fake["cwd"], env=env or fake["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    out: list[str] = []
    err: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    return proc, out, err


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children_records(logs: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(logs.glob("*.json"))]


def _redis_url_from(err: list[str]) -> str:
    return next(line.split("redis: ")[1].split()[0] for line in err if "redis: " in line)


def test_serve_starts_reports_and_stops_cleanly(fake_services):
    env = dict(fake_services["env"], BATON_API_KEY="the-api-key-0123")
    proc, out, err = _start_serve(fake_services, "--decode-workers", "2", env=env)
    try:
        assert _wait_for(lambda: any("Baton is serving" in l for l in out) or proc.poll() is not None, 60), err
        assert proc.poll() is None, "".join(err)
        line = next(l for l in out if "Baton is serving" in l)
        assert line.startswith("Baton is serving model at http://127.0.0.1:")
        # the summary: where the model came from, the KV room the decode workers report (read with
        # the key: /stats and /info need it), and that the API needs a key
        assert _wait_for(lambda: any("API key: required" in l for l in out), 10), out
        summary = "".join(out)
        assert f"model: {fake_services['model']}\n" in summary
        assert ("KV cache: 1600 tokens per decode worker (2); 3 request(s) of the longest length (512 tokens) "
                "fit in each at once") in summary, summary
        log = "".join(err)  # a line as each step starts
        for step in ("starting redis-server on port ", "loading model in 1 prefill + 2 decode worker(s) "
                     "(weights: model.safetensors 0 B)", "starting the gateway on 127.0.0.1:"):
            assert step in log, log
        records = _children_records(fake_services["logs"])
        kinds = sorted(r["argv"][0].split(os.sep)[-2] for r in records)
        assert kinds == ["decode_worker", "decode_worker", "gateway", "prefill_worker"]
        redis_url = _redis_url_from(err)  # as logged: without its password
        password = urlsplit(records[0]["env_redis"]).password
        assert password and len(password) >= 32 and password not in "".join(err)
        assert all(r["env_redis"] == redis_url.replace("***", password) for r in records)
        assert {r["argv"][0].split(os.sep)[-2]: r["env_api_key"] for r in records} == {
            "gateway": "the-api-key-0123", "prefill_worker": None, "decode_worker": None}
        for pid in [proc.pid, *(r["pid"] for r in records)]:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            assert password not in cmdline and "the-api-key-0123" not in cmdline
        import redis

        with pytest.raises(redis.AuthenticationError):  # NOAUTH: the private Redis wants the password
            redis.Redis(port=urlsplit(redis_url).port, socket_timeout=5).ping()
        threads = [r["config"]["threads"] for r in records if "threads" in r["config"]]
        assert len(threads) == 3 and (sum(threads) <= (os.cpu_count() or 1) or set(threads) == {1})
        pids = [r["pid"] for r in records]
        assert all(_alive(pid) for pid in pids)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0, "".join(err)
    assert _wait_for(lambda: not any(_alive(pid) for pid in pids), 10), "children left behind"
    assert _no_process_with(redis_url.split(":")[-1].split("/")[0], "redis")


def _no_process_with(*needles: str) -> bool:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles) and _alive(int(entry.name)):
            return False
    return True


def test_serve_sigterm_stops_cleanly(fake_services):
    proc, out, err = _start_serve(fake_services)
    assert _wait_for(lambda: any("Baton is serving" in l for l in out) or proc.poll() is not None, 60), err
    assert _wait_for(lambda: any("no API key: anyone who can reach the port can use it" in l for l in out), 10), out
    pids = [r["pid"] for r in _children_records(fake_services["logs"])]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == 0
    assert _wait_for(lambda: not any(_alive(pid) for pid in pids), 10)
    assert any("SIGTERM: stopping" in l for l in err)


def test_serve_restarts_a_dying_child_then_gives_up_and_stops_all(fake_services):
    # The only decode worker exits 1 s after every start: it is restarted with backoff (0.5, 1, 2,
    # 4, 8 s), and after its sixth death within a minute `baton serve` gives up on it; no decode
    # worker is left, so everything stops with a non-zero exit and no child is left behind.
    env = dict(fake_services["env"], FAKE_DIE_DECODE="1")
    proc, out, err = _start_serve(fake_services, env=env)
    try:
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    time.sleep(0.2)
    text = "".join(err)
    assert "decode_worker[0]" in text and "exited with code 3" in text, text
    assert text.count("restarting it in") == 5 and "giving up on it" in text, text
    records = _children_records(fake_services["logs"])
    decode = [r for r in records if r["argv"][0].split(os.sep)[-2] == "decode_worker"]
    assert len(decode) == 6  # the first start and five restarts
    pids = [r["pid"] for r in records]
    assert _wait_for(lambda: not any(_alive(pid) for pid in pids), 10), "children left behind"


def test_serve_keeps_serving_while_a_dead_worker_is_replaced(fake_services):
    # Two decode workers; one is killed: the other and the gateway keep running, the dead one is
    # restarted with a new pid, and `baton serve` itself never stops.
    proc, out, err = _start_serve(fake_services, "--decode-workers", "2")
    try:
        assert _wait_for(lambda: any("Baton is serving" in l for l in out) or proc.poll() is not None, 60), err
        records = _children_records(fake_services["logs"])
        victim = next(r["pid"] for r in records if r["argv"][0].split(os.sep)[-2] == "decode_worker")
        others = [r["pid"] for r in records if r["pid"] != victim]
        os.kill(victim, signal.SIGKILL)
        assert _wait_for(lambda: len(_children_records(fake_services["logs"])) == len(records) + 1, 30), err
        assert proc.poll() is None
        assert all(_alive(pid) for pid in others), "a survivor was stopped"
        assert any("was killed by signal 9; restarting it in" in l for l in err), "".join(err)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_serve_rejects_a_missing_model(tmp_path):
    result = subprocess.run(baton_cmd("serve", "--model", str(tmp_path / "nope")),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "not a model directory" in result.stderr


def test_vllm_style_serve_command_lines(tmp_path):
    """`baton serve MODEL --kv-cache-memory-bytes 2GiB --enable-auto-tool-choice --max-model-len N`, as a
    vLLM user types it: the model positional, vLLM's flag names reaching the children."""
    args = _serve_args("some/model", "--kv-cache-memory-bytes", "2GiB", "--enable-auto-tool-choice",
                       "--max-model-len", "4096")
    assert args.model_positional == "some/model" and args.kv_cache_memory == "2GiB"
    assert args.enable_auto_tool_choice is True
    specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2), python="py")
    assert child_config(specs[1]).kv_cache_memory == 2 << 30
    assert child_config(specs[-1]).max_model_len == 4096
    # two different models: refused at once, before anything starts
    from baton.cli.serve import run

    clash = _serve_args("a/model", "--model", "b/model")
    assert run(clash) == 2


def test_the_kv_line_says_when_seats_not_blocks_bound_the_batch():
    from baton.cli.startup_report import kv_capacity_line

    worker = {"num_kv_blocks_total": 1000, "block_size": 16, "max_num_seqs": 8}
    info = {"max_total_tokens": 512}
    # a small model's pool holds 31 requests of 512 tokens, but a worker runs 8 at once
    assert kv_capacity_line({"workers": {"decode": [worker]}}, info) == (
        "KV cache: 16000 tokens per decode worker (1); 8 request(s) run at once in each (--max-num-seqs), "
        "even of the longest length (512 tokens)")
    # a long context: the pool bounds it
    assert kv_capacity_line({"workers": {"decode": [worker]}}, {"max_total_tokens": 8192}) == (
        "KV cache: 16000 tokens per decode worker (1); 1 request(s) of the longest length (8192 tokens) "
        "fit in each at once")
    # serving starts with the first decode worker: the line says the others are still loading
    assert kv_capacity_line({"workers": {"decode": [worker]}}, info, decode_workers=3).startswith(
        "KV cache: 16000 tokens per decode worker (1 of 3 up, the others still loading); 8 request(s)")
