"""End to end: `baton serve` with the real gateway and workers on the tiny model.

Starts the whole deployment as a user would (its own private Redis), sends one completion, kills
the decode worker with SIGKILL and checks that it is replaced and the next completion is served,
then Ctrl-C (SIGINT) and checks that nothing it started is left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "prefill_worker", "decode_worker")
MISSING = [s for s in SERVICES if not (REPO / s / "__main__.py").exists()]

pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"services not written yet: {', '.join(m + '/__main__.py' for m in MISSING)}"
)

STARTUP_TIMEOUT = 180
STOP_TIMEOUT = 30


def _free_port() -> int:
    from baton.ops.redis_server import free_port

    return free_port()


def _baton() -> list[str]:
    exe = Path(sys.executable).parent / "baton"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "baton.ops.cli"]


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


def _left_behind(serve_pid: int, child_pids: set[int], redis_url: str) -> list[str]:
    left = []
    for pid, (ppid, cmdline) in _processes().items():
        if pid in child_pids or ppid == serve_pid:
            left.append(f"{pid}: {cmdline}")
        elif redis_url in cmdline and any(f"-m {s}" in cmdline for s in SERVICES):
            left.append(f"{pid}: {cmdline}")
    return left


def test_baton_serve_end_to_end(tiny_model_dir):
    import httpx

    port = _free_port()
    env = dict(os.environ)
    env.pop("REDIS_URL", None)  # let serve start (and stop) its own private Redis
    proc = subprocess.Popen(
        [*_baton(), "serve", "--model", str(tiny_model_dir), "--port", str(port),
         "--startup-timeout", str(STARTUP_TIMEOUT)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out: list[str] = []
    err: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()

    def log() -> str:
        return "".join(err[-80:])

    child_pids: set[int] = set()
    redis_url = ""
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not any("Baton is serving" in line for line in out):
            assert proc.poll() is None, f"baton serve exited with {proc.returncode}:\n{log()}"
            assert time.monotonic() < deadline, f"not serving after {STARTUP_TIMEOUT}s:\n{log()}"
            time.sleep(0.2)
        assert f"http://127.0.0.1:{port}" in next(l for l in out if "Baton is serving" in l)
        redis_url = next(l.split("redis: ")[1].split()[0] for l in err if "redis: " in l)
        child_pids = {pid for pid, (ppid, _) in _processes().items() if ppid == proc.pid}
        assert len(child_pids) >= 4, f"expected redis + 3 services, found {child_pids}"

        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=120) as client:
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

        # kill -9 the decode worker: baton serve restarts it and serves the next request
        decode_pid = int(next(l for l in err if "started decode_worker[0] (pid " in l)
                         .split("(pid ")[1].split(")")[0])
        os.kill(decode_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not any("decode_worker[0]" in l and "restarting it" in l for l in err):
            assert proc.poll() is None, f"baton serve exited after a worker died:\n{log()}"
            assert time.monotonic() < deadline, f"the dead decode worker was not restarted:\n{log()}"
            time.sleep(0.2)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            with httpx.Client(base_url=base, timeout=120) as client:
                again = client.post("/v1/completions",
                                    json={"model": model, "prompt": "Hello, my name is", "max_tokens": 8,
                                     "temperature": 0})
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(1)  # 503/429 while no decode worker is up yet
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == body["choices"][0]["text"]  # greedy: the same text
        assert proc.poll() is None
        child_pids |= {pid for pid, (ppid, _) in _processes().items() if ppid == proc.pid}
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
    while (left := _left_behind(proc.pid, child_pids, redis_url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "processes left behind:\n" + "\n".join(left)
