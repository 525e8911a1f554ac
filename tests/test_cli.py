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


def test_child_command_lines_pass_flags_through():
    args = _serve_args("--host", "0.0.0.0", "--port", "8123", "--dtype", "bfloat16", "--quantization", "int8",
                       "--kv-cache-dtype", "fp8", "--max-concurrent-requests", "64", "--max-queue-wait", "2.5", "--api-key", "k",
                       "--num-kv-blocks", "512", "--scheduler-policy", "max-utilization",
                       "--max-num-batched-tokens", "256", "--block-size", "16",
                       "--worker-metrics-port", "9100", "--decode-workers", "2",
                       "--log-format", "json", "--shutdown-grace", "12",
                       "--max-embedding-tokens", "4096", "--pooling-step-tokens", "32")
    plan = ThreadPlan([2], [1, 1], cpus=4)
    specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", plan, python="py")
    assert [s.name for s in specs] == ["prefill_worker[0]", "decode_worker[0]", "decode_worker[1]", "gateway"]
    pre, dec0, dec1, gw = (s.argv for s in specs)

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert pre[:3] == ["py", "-m", "prefill_worker"] and flag(pre, "--threads") == "2"
    assert flag(pre, "--max-num-batched-tokens") == "256" and "--num-kv-blocks" not in pre
    assert flag(pre, "--metrics-port") == "9100" and flag(dec0, "--metrics-port") == "9101"
    assert flag(dec1, "--metrics-port") == "9102"
    assert dec0[:3] == ["py", "-m", "decode_worker"] and flag(dec0, "--threads") == "1"
    assert flag(dec0, "--num-kv-blocks") == "512" and flag(dec0, "--scheduler-policy") == "max-utilization"
    assert flag(dec0, "--block-size") == "16" and flag(pre, "--block-size") == "16"
    assert flag(dec0, "--dtype") == "bfloat16" and "--max-num-batched-tokens" not in dec0
    assert flag(pre, "--quantization") == "int8" and flag(dec1, "--quantization") == "int8"
    assert flag(pre, "--kv-cache-dtype") == "fp8" and flag(dec1, "--kv-cache-dtype") == "fp8"
    assert gw[:3] == ["py", "-m", "gateway"] and flag(gw, "--port") == "8123"
    assert flag(gw, "--host") == "0.0.0.0" and flag(gw, "--max-concurrent-requests") == "64"
    assert flag(gw, "--max-queue-wait") == "2.5"
    assert "--threads" not in gw and "--max-input-tokens" not in gw
    assert float(flag(gw, "--shutdown-grace")) == 12 and "--shutdown-grace" not in pre
    assert flag(gw, "--max-embedding-tokens") == "4096" and "--max-embedding-tokens" not in pre
    assert flag(pre, "--pooling-step-tokens") == "32" and "--pooling-step-tokens" not in dec0
    for argv in (pre, dec0, dec1, gw):
        assert flag(argv, "--model") == "/m"
        assert flag(argv, "--log-format") == "json"  # every process logs the same way
    assert specs[0].env["OMP_NUM_THREADS"] == "2" and specs[1].env["OMP_NUM_THREADS"] == "1"


def test_the_prefill_kv_pool_flag_reaches_the_prefill_workers_only():
    """--prefill-kv-cache-memory is each prefill worker's --kv-cache-memory; --kv-cache-memory stays
    the decode workers' (a prefill worker given the decode pool's size would hold it all privately)."""
    args = _serve_args("--prefill-kv-cache-memory", "512MiB", "--kv-cache-memory", "2GiB", "--prefill-workers", "2")
    specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1, 1], [1], cpus=3), python="py")
    pre0, pre1, dec, gw = (s.argv for s in specs)
    for pre in (pre0, pre1):
        assert pre[pre.index("--kv-cache-memory") + 1] == "512MiB" and pre.count("--kv-cache-memory") == 1
    assert dec[dec.index("--kv-cache-memory") + 1] == "2GiB" and dec.count("--kv-cache-memory") == 1
    assert "--prefill-kv-cache-memory" not in " ".join(pre0 + dec + gw)
    # neither given (build_child_specs alone: `baton serve` fills in the prefill default first)
    plain = build_child_specs(_serve_args(), Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2),
                              python="py")
    assert all("--kv-cache-memory" not in s.argv for s in plain)


def test_served_model_names_and_strict_api_reach_the_gateway_only(monkeypatch):
    from gateway.__main__ import parse_args

    args = _serve_args("--served-model-name", "a", "b/c", "--strict-api")
    specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2), python="py")
    *workers, gw = (s.argv for s in specs)
    for argv in workers:
        assert "--served-model-name" not in argv and "--strict-api" not in argv
    # The gateway's own parser reads back exactly what baton serve passed.
    monkeypatch.setattr("baton.common.model_files.resolve_model", lambda model: Path("/m"))
    settings = parse_args(gw[3:])
    assert settings.served_model_names == ("a", "b/c") and settings.model_name == "a"
    assert settings.strict_api is True
    plain = build_child_specs(_serve_args(), Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2),
                              python="py")[-1].argv
    assert "--served-model-name" not in plain and "--strict-api" not in plain
    monkeypatch.delenv("BATON_STRICT_API", raising=False)
    settings = parse_args(plain[3:])
    assert settings.served_model_names == ("m",) and settings.strict_api is False


def test_child_secrets_travel_in_the_environment_not_on_argv():
    # argv is world-readable (`ps`, /proc/<pid>/cmdline); the services read REDIS_URL and
    # BATON_API_KEY from their environment by default.
    url = "redis://:s3cret-pw@127.0.0.1:1/0"
    args = _serve_args("--api-key", "k3y-value", "--decode-workers", "2")
    specs = build_child_specs(args, Path("/m"), url, ThreadPlan([1], [1, 1], cpus=4), python="py")
    for spec in specs:
        text = " ".join(spec.argv)
        assert "--redis-url" not in text and "s3cret-pw" not in text, spec.argv
        assert "--api-key" not in text and "k3y-value" not in text, spec.argv
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
parser = argparse.ArgumentParser()
parser.add_argument("--model"); parser.add_argument("--threads")
parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))  # as the real services do
parser.add_argument("--host"); parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()
with open(os.path.join(os.environ["FAKE_LOG_DIR"], f"{{KIND}}-{{os.getpid()}}.json"), "w") as f:
    json.dump({{"argv": sys.argv, "pid": os.getpid(), "env_redis": os.environ.get("REDIS_URL"),
               "env_api_key": os.environ.get("BATON_API_KEY"),
               "omp": os.environ.get("OMP_NUM_THREADS")}}, f)
client = redis.Redis.from_url(args.redis_url)
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
    server = HTTPServer((args.host, args.port), H)
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
        threads = [int(r["argv"][r["argv"].index("--threads") + 1]) for r in records if "--threads" in r["argv"]]
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
    decode, gateway = specs[1].argv, specs[-1].argv
    assert decode[decode.index("--kv-cache-memory") + 1] == "2GiB"
    assert gateway[gateway.index("--max-model-len") + 1] == "4096"
    # two different models: refused at once, before anything starts
    from baton.cli.serve import run

    clash = _serve_args("a/model", "--model", "b/model")
    assert run(clash) == 2
