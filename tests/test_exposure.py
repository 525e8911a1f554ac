"""Issue 20 (7): a gateway that listens beyond loopback with no API key says so, once, at start-up
(`python -m gateway` and `baton serve`, whose image listens on 0.0.0.0 by default)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from baton.cli.redis_server import free_port
from gateway.hosts import exposure_warning

WARNING = "without --api-key: anyone who can reach this address can use the API"


@pytest.mark.parametrize("host, api_key, warns", [
    ("0.0.0.0", None, True), ("::", None, True), ("", None, True), ("192.168.1.20", None, True),
    ("example.com", None, True), ("0.0.0.0", "", True),
    ("127.0.0.1", None, False), ("127.0.0.2", None, False), ("localhost", None, False), ("::1", None, False),
    ("[::1]", None, False), ("0.0.0.0", "k3y", False), ("::", "k3y", False),
])
def test_the_warning_is_for_an_open_api_beyond_loopback(host, api_key, warns):
    warning = exposure_warning(host, 8000, api_key)
    assert (warning is not None) == warns
    if warns:
        assert WARNING in warning and ":8000" in warning and "127.0.0.1" in warning


class Output:
    """A child's stderr, read in a thread, line by line."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the last lines
                return any(text in line for line in self.lines)
            time.sleep(0.1)
        return False


def _start(argv: list[str], **env: str) -> tuple[subprocess.Popen, Output]:
    environ = {k: v for k, v in os.environ.items() if k not in ("BATON_API_KEY", "REDIS_URL")}
    proc = subprocess.Popen(argv, env={**environ, "PYTHONUNBUFFERED": "1", **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, Output(proc)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _gateway(model_dir: Path, host: str, port: int, redis_url: str) -> list[str]:
    return [sys.executable, "-m", "gateway", "--model", str(model_dir), "--host", host, "--port", str(port),
            "--redis-url", redis_url]


def _live(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/live", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            time.sleep(0.2)
    return False


def test_the_gateway_warns_at_start_up_when_open_beyond_loopback(tiny_model_dir, redis_url):
    port = free_port()
    proc, out = _start(_gateway(tiny_model_dir, "0.0.0.0", port, redis_url))
    try:
        assert out.wait_for(WARNING, 60), "".join(out.lines)[-3000:]
        assert _live(port, 60)
        [line] = [line for line in out.lines if WARNING in line]
        assert "WARNING" in line and f"0.0.0.0:{port}" in line
    finally:
        _stop(proc)


@pytest.mark.parametrize("case", ["loopback", "api key"])
def test_no_warning_on_loopback_or_with_a_key(tiny_model_dir, redis_url, case):
    port = free_port()
    if case == "loopback":
        proc, out = _start(_gateway(tiny_model_dir, "127.0.0.1", port, redis_url))
    else:
        proc, out = _start(_gateway(tiny_model_dir, "0.0.0.0", port, redis_url), BATON_API_KEY="k3y-from-env")
    try:
        assert _live(port, 60), "".join(out.lines)[-3000:]
        assert not any(WARNING in line for line in out.lines)
    finally:
        _stop(proc)


def test_baton_serve_passes_the_warning_on(tiny_model_dir, redis_url):
    """The image runs `baton serve --host 0.0.0.0`: its output (what `docker logs` shows) has it."""
    exe = Path(sys.executable).parent / "baton"
    baton = [str(exe)] if exe.exists() else [sys.executable, "-m", "baton.cli.cli"]
    port = free_port()
    proc, out = _start([*baton, "serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0", "--port", str(port),
                        "--dtype", "float32", "--threads-per-worker", "1"], REDIS_URL=redis_url)
    try:
        assert out.wait_for(WARNING, 120), "".join(out.lines)[-3000:]
    finally:
        _stop(proc, signal.SIGINT)
