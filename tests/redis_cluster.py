"""A throwaway Redis Cluster on loopback ports, for tests: 3 masters, each with `replicas` replicas
(none by default), nothing on disk; a node timeout of 2 s, so a killed master's replica takes over
within seconds."""

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

from baton.cli.redis_server import child_preexec, find_redis_server


NODE_TIMEOUT_MS = 2000


class RedisClusterServers:
    def __init__(self, masters: int = 3, ports: list[int] | None = None, replicas: int = 0) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="baton-redis-cluster-"))
        self.ports = ports or cluster_ports(masters * (1 + replicas))
        self.replicas = replicas
        self.procs_by_port: dict[int, subprocess.Popen] = {}
        self.procs: list[subprocess.Popen] = []
        try:
            server = find_redis_server()
            for port in self.ports:
                node_dir = self.workdir / str(port)
                node_dir.mkdir()
                self.procs.append(subprocess.Popen(
                    [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                     "--cluster-config-file", "nodes.conf", "--dir", str(node_dir), "--save", "",
                     "--appendonly", "no", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                     "--logfile", str(node_dir / "log")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    # dies with this test process, even one killed by SIGKILL
                    preexec_fn=child_preexec(new_session=False, death_signal=signal.SIGKILL)))
                self.procs_by_port[port] = self.procs[-1]
            for port in self.ports:
                self._wait_answering(port)
            cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
            assert cli, "redis-cli is needed to create a cluster"
            subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", str(replicas), "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=30)
            self._wait_cluster_ok()
            if replicas:
                self._wait_replicas_synced()
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

    def _wait_replicas_synced(self, timeout: float = 30) -> None:
        """Every replica has done its first sync (else its master's death would leave a slot that no
        replica may take over)."""
        deadline = time.monotonic() + timeout
        while True:
            infos = {p: self.node(p).info("replication") for p in self.ports}
            links = {p: info.get("master_link_status") for p, info in infos.items() if info["role"] == "slave"}
            if len(links) == len(self.ports) // (1 + self.replicas) * self.replicas and all(
                    link == "up" for link in links.values()):
                return
            assert time.monotonic() < deadline, f"replicas not synced after {timeout}s: {links}"
            time.sleep(0.1)

    def live_ports(self) -> list[int]:
        return [port for port in self.ports if self.procs_by_port[port].poll() is None]

    def masters(self) -> list[int]:
        """The ports of the live nodes that are masters now."""
        return [port for port in self.live_ports() if self.node(port).info("replication")["role"] == "master"]

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key`'s slot now."""
        port = self.live_ports()[0]
        slot = self.node(port).cluster("keyslot", key)
        for start, end, master, *_replicas in self.node(port).cluster("slots"):
            if start <= slot <= end:
                return int(master[1])
        raise AssertionError(f"no master serves slot {slot}")

    def kill(self, port: int) -> None:
        """SIGKILL the node on `port` (a crash: no goodbye to the other nodes)."""
        proc = self.procs_by_port[port]
        proc.kill()
        proc.wait()

    def wait_failover(self, dead: int, timeout: float) -> float:
        """Wait until every live node sees the cluster ok again and none counts `dead` among the
        masters (its replica took its slots); returns the seconds it took."""
        start = time.monotonic()
        while True:
            try:
                live = self.live_ports()
                if all(self.node(p).cluster("info").get("cluster_state") == "ok" for p in live) and all(
                        int(master[1]) != dead for p in live
                        for _s, _e, master, *_r in self.node(p).cluster("slots")):
                    return time.monotonic() - start
            except redis.RedisError:
                pass
            assert time.monotonic() - start < timeout, f"no failover of {dead} within {timeout}s"
            time.sleep(0.05)

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
