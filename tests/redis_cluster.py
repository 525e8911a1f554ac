"""A throwaway 3-master Redis Cluster on loopback ports, for tests (no replicas, nothing on disk)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from baton.ops.redis_server import child_preexec, find_redis_server


class RedisClusterServers:
    def __init__(self, masters: int = 3, ports: list[int] | None = None) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="baton-redis-cluster-"))
        self.ports = ports or cluster_ports(masters)
        self.procs: list[subprocess.Popen] = []
        try:
            server = find_redis_server()
            for port in self.ports:
                node_dir = self.workdir / str(port)
                node_dir.mkdir()
                self.procs.append(subprocess.Popen(
                    [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                     "--cluster-config-file", "nodes.conf", "--dir", str(node_dir), "--save", "",
                     "--appendonly", "no", "--cluster-node-timeout", "2000", "--logfile", str(node_dir / "log")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    # dies with this test process, even one killed by SIGKILL
                    preexec_fn=child_preexec(new_session=False, death_signal=signal.SIGKILL)))
            for port in self.ports:
                self._wait_answering(port)
            cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
            assert cli, "redis-cli is needed to create a cluster"
            subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=30)
            self._wait_cluster_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """The URL Baton's processes take: any node seeds the client."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5)

    def _wait_answering(self, port: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.node(port).ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _wait_cluster_ok(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = [self.node(p).cluster("info").get("cluster_state") for p in self.ports]
            if all(state == "ok" for state in states):
                return
            assert time.monotonic() < deadline, f"cluster not ok after {timeout}s: {states}"
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def all_stopped(self) -> bool:
        return all(proc.poll() is not None for proc in self.procs) and not any(
            _pid_alive(proc.pid) for proc in self.procs)

    def __enter__(self) -> "RedisClusterServers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def cluster_ports(n: int) -> list[int]:
    """`n` free ports a cluster node can take: at most 55535, with port + 10000 (its cluster bus)
    free too; redis-server refuses a higher port in cluster mode (an OS-assigned one often is)."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(20000, 55535)
        if port not in ports and _free(port) and _free(port + 10000):
            ports.append(port)
    return ports


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
