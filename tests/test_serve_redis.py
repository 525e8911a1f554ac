"""`baton serve`'s private Redis: a password, not on any command line; restarted on the same port
when it dies (and given up on after repeated deaths); never outliving a `baton serve` killed with
SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from baton.cli.redis_server import PrivateRedis, start_private_redis
from baton.cli.supervisor import ChildExited, Supervisor

PASSWORD = "test-password-Zq9xW2"


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.fixture
def private_redis():
    server = start_private_redis(password=PASSWORD)
    yield server
    server.stop()


def test_private_redis_refuses_clients_without_the_password(private_redis: PrivateRedis):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=private_redis.port, socket_timeout=5).ping()
    assert redis.Redis.from_url(private_redis.url, socket_timeout=5).ping()
    assert PASSWORD in private_redis.url and PASSWORD not in private_redis.display_url
    # Not on its command line (`ps`); in a config file only we can read.
    assert PASSWORD not in _cmdline(private_redis.process.pid)
    assert stat.S_IMODE(os.stat(private_redis.workdir).st_mode) == 0o700
    assert stat.S_IMODE(private_redis.config_path.stat().st_mode) == 0o600


def test_private_redis_restarts_on_the_same_port_with_the_same_password(private_redis: PrivateRedis):
    client = redis.Redis.from_url(private_redis.url, socket_timeout=5)
    client.set("k", "v")
    old_pid, port = private_redis.process.pid, private_redis.port
    os.kill(old_pid, signal.SIGKILL)
    private_redis.restart()
    assert private_redis.process.pid != old_pid and private_redis.port == port
    assert client.get("k") is None  # it comes back empty (nothing persisted), reachable by the same URL
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, socket_timeout=5).ping()


def test_supervisor_restarts_a_dead_redis_then_gives_up(private_redis: PrivateRedis):
    # Two deaths within the window are restarted (after 0.5 s, then 1 s); the third is fatal.
    logs: list[str] = []
    sup = Supervisor(log=logs.append, max_restarts=2, restart_window=60)
    sup.watch("redis-server", private_redis)
    for _ in range(2):
        old_pid = private_redis.process.pid
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while private_redis.process.pid == old_pid or private_redis.process.poll() is not None:
            assert time.monotonic() < deadline, logs
            sup.sleep(0.1)
        assert redis.Redis.from_url(private_redis.url, socket_timeout=5).ping()
    assert sum("restarting it in" in line for line in logs) == 2, logs
    os.kill(private_redis.process.pid, signal.SIGKILL)
    with pytest.raises(ChildExited, match="redis-server .* killed by signal 9: died 3 times within 60s; "
                                          "giving up on it"):
        sup.sleep(5)


def test_a_child_whose_arguments_are_refused_is_not_restarted():
    """A usage error (exit 2) would repeat on every restart: it ends `baton serve` at once."""
    from baton.cli.supervisor import ChildSpec

    logs: list[str] = []
    sup = Supervisor(log=logs.append, max_restarts=5, restart_window=60)
    sup.start(ChildSpec("prefill-0", [sys.executable, "-c", "import sys; sys.exit(2)"], role="prefill"))
    with pytest.raises(ChildExited, match="prefill-0 .* exited with code 2: its command line was refused"):
        sup.sleep(10)
    assert not any("restarting it in" in line for line in logs), logs
    # any other exit is restarted as before
    sup = Supervisor(log=logs.append, max_restarts=5, restart_window=60)
    sup.start(ChildSpec("decode-0", [sys.executable, "-c", "import sys; sys.exit(1)"], role="decode"))
    deadline = time.monotonic() + 10
    while not any("decode-0" in line and "restarting it in" in line for line in logs):
        assert time.monotonic() < deadline, logs
        sup.sleep(0.1)
    sup.stop_all()


def test_redis_and_children_die_with_a_killed_baton_serve(tiny_model_dir):
    # SIGKILL leaves `baton serve` no chance to clean up: the kernel must stop its children
    # (PR_SET_PDEATHSIG), Redis first among them, or it would hold its port and data forever.
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    exe = Path(sys.executable).parent / "baton"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "baton.cli.cli"]
    from baton.cli.redis_server import free_port

    proc = subprocess.Popen([*cmd, "serve", "--model", str(tiny_model_dir), "--port", str(free_port())],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    try:
        assert _wait_for(lambda: any("started gateway" in line for line in err) or proc.poll() is not None,
                         120), "".join(err)
        assert proc.poll() is None, "".join(err)
        redis_pid = int(next(line for line in err if "(private, pid " in line).split("pid ")[1].split(")")[0])
        children = {int(line.split("(pid ")[1].split(")")[0]) for line in err if "started " in line}
        assert len(children) == 3 and _alive(redis_pid)
        workdir = os.readlink(f"/proc/{redis_pid}/cwd")  # redis-server runs in its private directory
        time.sleep(1)  # let the children get going (their own signal handlers installed)
    finally:
        proc.kill()
        proc.wait()
    assert _wait_for(lambda: not _alive(redis_pid), 5), f"redis-server {redis_pid} outlived baton serve"
    shutil.rmtree(workdir, ignore_errors=True)  # a SIGKILLed serve cannot remove it itself
    assert _wait_for(lambda: not any(_alive(pid) for pid in children), 20), \
        f"children outlived baton serve: {[p for p in children if _alive(p)]}"
