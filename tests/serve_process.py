"""`baton serve` as a user starts it, for a test: a subprocess on a free port, its log kept, ready
when it says "Baton is serving", stopped with Ctrl-C (SIGINT) and checked to exit cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

STOP_TIMEOUT = 30


def baton_command() -> list[str]:
    exe = Path(sys.executable).parent / "baton"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "baton.cli.cli"]


def free_port() -> int:
    """A free port for a server a test starts (see `free_port_run`)."""
    return free_port_run(1)


def free_port_run(count: int) -> int:
    """A port P such that P .. P + count - 1 are all free now (what `--worker-metrics-port P` takes:
    one port per worker), drawn below the kernel's ephemeral range so that no outgoing connection
    (Redis clients open dozens) takes one of them in the meantime, as a port the kernel handed out
    can be (a CI run failed on the decode worker's P + 1, in use)."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(10000, max(10001, low - count))
        try:
            for port in range(start, start + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return start
    raise RuntimeError(f"no run of {count} free ports below {low}")


class ServeProcess:
    """`with ServeProcess(["--model", dir]) as serve:` -> serve.base_url answers the API."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, startup_timeout: float = 180) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [*args, "--port", str(self.port), "--startup-timeout", str(startup_timeout)]
        self.env = dict(os.environ if env is None else env)
        self.env.pop("REDIS_URL", None)  # its own private Redis, started and stopped by serve
        self.startup_timeout = startup_timeout
        self.out: list[str] = []
        self.err: list[str] = []
        self.proc: subprocess.Popen[str] | None = None

    def log(self) -> str:
        return "".join(self.err[-80:])

    def __enter__(self) -> ServeProcess:
        self.proc = subprocess.Popen([*baton_command(), "serve", *self.args], env=self.env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        try:
            while not any("Baton is serving" in line for line in self.out):
                assert self.proc.poll() is None, f"baton serve exited with {self.proc.returncode}:\n{self.log()}"
                assert time.monotonic() < deadline, f"not serving after {self.startup_timeout}s:\n{self.log()}"
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; its exit status (killed if it overstays STOP_TIMEOUT)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"baton serve did not stop within {STOP_TIMEOUT}s of SIGINT:\n{self.log()}")

    def __exit__(self, *exc: object) -> None:
        code = self.stop()
        if exc[0] is None:
            assert code == 0, f"baton serve exited with {code}:\n{self.log()}"
