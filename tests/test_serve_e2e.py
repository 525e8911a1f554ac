"""End to end: `baton serve` with the real gateway and workers on the tiny model.

Starts the whole deployment as a user would (its own private Redis, an API key from the
environment), checks that no secret is on a command line, sends one completion, kills the decode
worker with SIGKILL and checks that it is replaced and the next completion is served, kills the
private Redis with SIGKILL under a streaming request and checks that the stream ends and the next
completion is served again, then Ctrl-C (SIGINT) and checks that nothing it started is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.serve_process import baton_command, free_port, free_port_run

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "prefill_worker", "decode_worker")
MISSING = [s for s in SERVICES if not (REPO / s / "__main__.py").exists()]

pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"services not written yet: {', '.join(m + '/__main__.py' for m in MISSING)}"
)

STARTUP_TIMEOUT = 180
STOP_TIMEOUT = 30
API_KEY = "e2e-api-key-7f3a9c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, cmdline) of every live (non-zombie) process."""
    found: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        found[int(entry.name)] = (int(fields[1]), cmdline)
    return found


def _service_config(pid: int) -> dict:
    """The config `baton serve` handed its child `pid`: JSON in its BATON_SERVICE_CONFIG ({}: none)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    prefix = b"BATON_SERVICE_CONFIG="
    return next((json.loads(v[len(prefix):]) for v in environ if v.startswith(prefix)), {})


def _left_behind(serve_pid: int, child_pids: set[int], model_dir: Path) -> list[str]:
    left = []
    for pid, (ppid, cmdline) in _processes().items():
        if pid in child_pids or ppid == serve_pid:
            left.append(f"{pid}: {cmdline}")
        elif any(f"-m {s}" in cmdline for s in SERVICES) and str(model_dir) in json.dumps(_service_config(pid)):
            left.append(f"{pid}: {cmdline}")
    return left


def _pid_in(lines: list[str], marker: str) -> int:
    """The pid in the last log line containing `marker` + 'pid N)'."""
    line = [l for l in lines if marker in l][-1]
    return int(line.split("pid ")[1].split(")")[0])


def _complete(base: str, model: str, deadline: float) -> "httpx.Response":
    """The reference greedy completion, retried while the deployment recovers (503/429)."""
    import httpx

    while True:
        try:
            with httpx.Client(base_url=base, timeout=120, headers=AUTH) as client:
                resp = client.post("/v1/completions", json={"model": model, "prompt": "Hello, my name is",
                                                            "max_tokens": 8, "temperature": 0})
            if resp.status_code == 200 or time.monotonic() > deadline:
                return resp
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def _stream(base: str, model: str, started: threading.Event, ended: list[str]) -> None:
    """A long streaming completion; records how it ended: '[DONE]' after tokens, 'error: ...' for
    an error event, or the exception that cut it off."""
    import httpx

    how = ""
    try:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=120) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                started.set()
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    how = how or "[DONE]"
                elif "error" in json.loads(data):
                    how = f"error: {json.loads(data)['error']}"
        ended.append(how or f"no ending (status {resp.status_code})")
    except Exception as exc:  # noqa: BLE001 -- recorded for the assertion
        ended.append(f"{type(exc).__name__}: {exc}")
    finally:
        started.set()


def _borrowed_steps(metrics_port: int) -> float:
    """Steps the decode worker has run with threads an idle prefill worker lent it (its metrics)."""
    import httpx

    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return float(next(line.rsplit(" ", 1)[1] for line in metrics.splitlines()
                      if line.startswith("baton:worker_borrowed_steps_total{")))


def _decode_borrows(base: str, model: str, metrics_port: int) -> bool:
    """Whether a 64-token completion (long enough for an idle prefill worker's threads to be lent)
    ran some of its decode steps on the lent threads."""
    import httpx

    before = _borrowed_steps(metrics_port)
    with httpx.Client(base_url=base, timeout=120, headers=AUTH) as client:
        resp = client.post("/v1/completions", json={"model": model, "prompt": "Hello, my name is", "max_tokens": 64,
                                                    "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return _borrowed_steps(metrics_port) > before


def _check_no_secret_on_argv(pids: set[int], secrets_: list[str]) -> None:
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for secret in secrets_:
            assert secret not in cmdline, f"a secret is on the command line of pid {pid}: visible in ps"


def test_baton_serve_end_to_end(tiny_model_dir):
    import httpx

    port = free_port()
    metrics_port = free_port_run(2)  # prefill worker's; the decode worker's is the next one
    import redis
    from baton.cli.serve import available_cpus

    env = dict(os.environ, BATON_API_KEY=API_KEY)
    env.pop("REDIS_URL", None)  # let serve start (and stop) its own private Redis
    proc = subprocess.Popen(
        [*baton_command(), "serve", "--model", str(tiny_model_dir), "--port", str(port),
         "--startup-timeout", str(STARTUP_TIMEOUT), "--worker-metrics-port", str(metrics_port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out: list[str] = []
    err: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()

    def log() -> str:
        return "".join(err[-80:])

    child_pids: set[int] = set()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not any("Baton is serving" in line for line in out):
            assert proc.poll() is None, f"baton serve exited with {proc.returncode}:\n{log()}"
            assert time.monotonic() < deadline, f"not serving after {STARTUP_TIMEOUT}s:\n{log()}"
            time.sleep(0.2)
        assert f"http://127.0.0.1:{port}" in next(l for l in out if "Baton is serving" in l)
        child_pids = {pid for pid, (ppid, _) in _processes().items() if ppid == proc.pid}
        assert len(child_pids) >= 4, f"expected redis + 3 services, found {child_pids}"

        # The private Redis has a password; it and the API key reach the children through their
        # environment only (argv is world-readable), and serve's log shows neither.
        gateway_pid = _pid_in(err, "started gateway (pid ")
        environ = dict(kv.split("=", 1) for kv in
                       Path(f"/proc/{gateway_pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
        password = urlsplit(environ["REDIS_URL"]).password
        redis_port = urlsplit(environ["REDIS_URL"]).port
        assert password and environ.get("BATON_API_KEY") == API_KEY
        _check_no_secret_on_argv(child_pids | {proc.pid}, [password, API_KEY])
        assert password not in "".join(err) and API_KEY not in "".join(err)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis_port, socket_timeout=5).ping()

        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=120) as client:
            assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        with httpx.Client(base_url=base, timeout=120, headers=AUTH) as client:
            model = tiny_model_dir.name
            try:
                listed = client.get("/v1/models")
                if listed.status_code == 200 and listed.json().get("data"):
                    model = listed.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError):
                pass
            resp = client.post("/v1/completions",
                               json={"model": model, "prompt": "Hello, my name is", "max_tokens": 8,
                                     "temperature": 0})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        usage = body.get("usage") or {}
        assert usage.get("prompt_tokens", 0) > 0, body
        assert usage.get("completion_tokens", 0) > 0, body
        assert body["choices"] and isinstance(body["choices"][0].get("text"), str), body

        # One core each (2 cores): while the prefill worker is idle, the decode worker's steps run
        # on its thread too (through the core-share ledger: a memfd serve made, nothing on disk).
        ledger = next(_service_config(pid)["core_share"] for pid, (_, cmd) in _processes().items()
                      if "-m decode_worker" in cmd)
        assert ledger.startswith("/proc/self/fd/"), ledger
        if available_cpus() >= 2:
            assert _decode_borrows(base, model, metrics_port + 1)

        # kill -9 the decode worker: baton serve restarts it and serves the next request
        decode_pid = int(next(l for l in err if "started decode_worker[0] (pid " in l)
                         .split("(pid ")[1].split(")")[0])
        os.kill(decode_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not any("decode_worker[0]" in l and "restarting it" in l for l in err):
            assert proc.poll() is None, f"baton serve exited after a worker died:\n{log()}"
            assert time.monotonic() < deadline, f"the dead decode worker was not restarted:\n{log()}"
            time.sleep(0.2)
        again = _complete(base, model, time.monotonic() + STARTUP_TIMEOUT)  # 503/429 until it is up
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == body["choices"][0]["text"]  # greedy: the same text
        if available_cpus() >= 2:  # the new decode worker borrows too (its predecessor's record cleared)
            assert _decode_borrows(base, model, metrics_port + 1)
        assert proc.poll() is None
        child_pids |= {pid for pid, (ppid, _) in _processes().items() if ppid == proc.pid}

        # kill -9 the private Redis under a streaming request: serve restarts it (same port, same
        # password, empty), the stream ends (tokens or a clear error), and new requests are served.
        started, ended = threading.Event(), []
        streamer = threading.Thread(target=_stream, args=(base, model, started, ended), daemon=True)
        streamer.start()
        assert started.wait(60), f"the streaming request produced nothing:\n{log()}"
        redis_pid = _pid_in(err, "(private, pid ")
        os.kill(redis_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not any("restarted redis-server" in l for l in err):
            assert proc.poll() is None, f"baton serve exited after its Redis died:\n{log()}"
            assert time.monotonic() < deadline, f"the dead redis-server was not restarted:\n{log()}"
            time.sleep(0.2)
        after = _complete(base, model, time.monotonic() + 60)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == body["choices"][0]["text"]
        streamer.join(90)
        assert ended, "the streaming request in flight when Redis died never ended"
        assert ended[0] == "[DONE]" or ended[0].startswith("error: "), ended  # tokens or a clear error
        assert proc.poll() is None
        with pytest.raises(redis.AuthenticationError):  # the new Redis has the same password
            redis.Redis(port=redis_port, socket_timeout=5).ping()
        child_pids |= {pid for pid, (ppid, _) in _processes().items() if ppid == proc.pid}

        # kill -9 the prefill worker: restarted, the same greedy text again, and the deployment
        # ends idle with as many workers as were asked for.
        prefill_pid = _pid_in(err, "started prefill_worker[0] (pid ")
        os.kill(prefill_pid, signal.SIGKILL)
        again = _complete(base, model, time.monotonic() + STARTUP_TIMEOUT)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == body["choices"][0]["text"]
        assert any("prefill_worker[0]" in l and "restarting it" in l for l in err), log()
        deadline = time.monotonic() + 30
        while True:
            stats = httpx.get(base + "/stats", headers=AUTH, timeout=10).json()
            workers = stats["workers"]
            idle = (stats["token_budget"]["in_use"] == 0 and stats["requests"]["running"] == 0
                    and len(workers["prefill"]) == 1 and len(workers["decode"]) == 1
                    and all(w["num_kv_blocks_used"] == 0 for w in workers["decode"]))
            if idle:
                break
            assert time.monotonic() < deadline, f"not idle with 1+1 workers: {stats}"
            time.sleep(0.5)
        child_pids |= {pid for pid, (ppid, _) in _processes().items() if ppid == proc.pid}
        _check_no_secret_on_argv(child_pids, [password, API_KEY])
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"baton serve did not stop within {STOP_TIMEOUT}s of SIGINT:\n{log()}")

    assert proc.returncode == 0, log()
    deadline = time.monotonic() + STOP_TIMEOUT
    while (left := _left_behind(proc.pid, child_pids, tiny_model_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "processes left behind:\n" + "\n".join(left)
