"""A whole Baton system for a test: private redis-server (or a given Redis URL), workers,
gateways on free ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import redis

from baton.common import heartbeats
from baton.cli.redis_server import PrivateRedis, free_port, start_private_redis
from baton.common.redis_client import connect_sync


class Cluster:
    def __init__(self, model_dir: Path, prefill: int = 1, decode: int = 1, gateway_args: tuple[str, ...] = (),
                 prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
                 dtype: str = "float32", gateways: int = 1, redis_url: str | None = None) -> None:
        """`redis_url`: use that Redis (say, a Redis Cluster's URL) instead of a private one."""
        self.model_dir = Path(model_dir)
        self.redis: PrivateRedis | None = None if redis_url else start_private_redis()
        self.redis_url = redis_url or self.redis.url
        self.client: redis.Redis = connect_sync(self.redis_url)
        self.ports = [free_port() for _ in range(gateways)]
        self.port = self.ports[0]
        self.base_urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.base_url = self.base_urls[0]
        self.dtype = dtype
        self.prefill_args, self.decode_args = prefill_args, decode_args
        self.log_dir = Path(os.environ.get("BATON_TEST_LOGS", "/tmp/baton-test-logs"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            for i in range(prefill):
                self.start_worker("prefill_worker", f"prefill-{i}")
            for i in range(decode):
                self.start_worker("decode_worker", f"decode-{i}")
            for i, port in enumerate(self.ports):
                self._spawn("gateway" if i == 0 else f"gateway-{i}", [
                    sys.executable, "-m", "gateway", "--model", str(self.model_dir), "--port", str(port),
                    "--redis-url", self.redis_url, *gateway_args])
            self.wait_ready(prefill, decode)
        except BaseException:
            self.stop()  # a cluster that failed to start must not leave its processes behind
            raise

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}-{self.port}.log", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_ENDPOINT="http://127.0.0.1:9")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def start_worker(self, module: str, worker_id: str, dtype: str | None = None,
                     args: tuple[str, ...] = ()) -> subprocess.Popen:
        """`args`: this worker's own flags, after its pool's (say, a metrics port of its own)."""
        extra = self.prefill_args if module == "prefill_worker" else self.decode_args
        return self._spawn(worker_id, [
            sys.executable, "-m", module, "--model", str(self.model_dir), "--redis-url", self.redis_url,
            "--threads", "1", "--dtype", dtype or self.dtype, "--worker-id", worker_id, "--claim-idle-ms", "500",
            *extra, *args])

    def wait_ready(self, prefill: int, decode: int, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: see {self.log_dir}")
            try:
                healths = [httpx.get(url + "/health", timeout=2).json() for url in self.base_urls]
                if all(h.get("prefill_workers", 0) >= prefill and h.get("decode_workers", 0) >= decode
                       for h in healths):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError("the system did not become ready")

    def stats(self) -> dict:
        return httpx.get(self.base_url + "/stats", timeout=5).json()

    def worker_states(self, kind: str) -> list[dict]:
        return [msgpack.unpackb(value) for _key, value in heartbeats.live_sync(self.client, kind)]

    def fresh_worker_states(self, kind: str, timeout: float = 30) -> list[dict]:
        """Heartbeats written after this call began: on a loaded machine a worker's last beat can
        be seconds old, and an old beat describes an old state."""
        since = time.time()
        deadline = since + timeout
        while True:
            states = self.worker_states(kind)
            if states and all(s.get("time", 0) >= since for s in states):
                return states
            assert time.time() < deadline, f"no fresh {kind} heartbeat within {timeout}s: {states}"
            time.sleep(0.1)

    def wait_idle(self, timeout: float = 30) -> dict:
        """Wait until budget, running requests and KV blocks in use are all back to zero."""
        deadline = time.time() + timeout
        stats: dict = {}
        while time.time() < deadline:
            stats = self.stats()
            decode = self.fresh_worker_states("decode")
            if (stats["token_budget"]["in_use"] == 0 and stats["requests"]["running"] == 0
                    and stats["requests"]["waiting"] == 0 and decode
                    and all(d["num_kv_blocks_used"] == 0 and d["num_requests_running"] == 0 for d in decode)):
                return stats
            time.sleep(0.3)
        raise AssertionError(f"not idle after {timeout}s: {stats} {self.worker_states('decode')}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.client.close()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
