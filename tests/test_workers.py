"""The two worker kinds over a real Redis: handoff through the block store, parity, cancels, dead letters.

The gateway is not involved: the test plays the gateway's part of the protocol directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
import redis

from baton.common import heartbeats, protocol
from baton.common.sampling_params import SamplingParams


def start_worker(module: str, model_dir, redis_url: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", module, "--model", str(model_dir), "--redis-url", redis_url, "--threads", "1",
         "--dtype", "float32", "--claim-idle-ms", "1000", *extra],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_heartbeats(client: redis.Redis, kinds: list[str], timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        present = {k.decode().split(":")[2] for k, _ in heartbeats.live_sync(client)}
        if all(kind in present for kind in kinds):
            return
        time.sleep(0.2)
    raise TimeoutError(f"workers {kinds} did not start")


class Gateway:
    """The gateway's half of the protocol, synchronously."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.gateway_id = "test-" + uuid.uuid4().hex[:8]
        self.last_id = b"0-0"
        self.events: dict[str, list[protocol.TokenEvent]] = {}
        pipe = client.pipeline(transaction=False)
        heartbeats.queue_beat(pipe, "gateway", self.gateway_id, {"worker_id": self.gateway_id}, 3600)
        # A gateway makes its own token stream (workers never create it): empty, through a group.
        pipe.xgroup_create(protocol.token_stream(self.gateway_id), "keepalive", id="$", mkstream=True)
        pipe.execute()

    def submit(self, prompt_ids: list[int], max_tokens: int, **sampling) -> str:
        request_id = uuid.uuid4().hex
        request = protocol.PrefillRequest(request_id, self.gateway_id, prompt_ids,
                                          SamplingParams(max_tokens=max_tokens, **sampling), time.time())
        self.client.xadd(protocol.PREFILL_STREAM, {protocol.PAYLOAD_FIELD: protocol.encode(request)})
        self.events[request_id] = []
        return request_id

    def cancel(self, request_id: str) -> None:
        self.client.xadd(protocol.CANCEL_STREAM, {protocol.PAYLOAD_FIELD: protocol.encode(
            protocol.Cancel(request_id, self.gateway_id))})

    def pump(self, block_ms: int = 200) -> None:
        reply = self.client.xread({protocol.token_stream(self.gateway_id): self.last_id}, block=block_ms, count=1000)
        for _, entries in reply or []:
            for message_id, fields in entries:
                self.last_id = message_id
                message = protocol.decode(fields[protocol.PAYLOAD_FIELD])
                events = message.events if isinstance(message, protocol.TokenBatch) else [message]
                for event in events:
                    self.events.setdefault(event.request_id, []).append(event)

    def finished(self, request_id: str) -> bool:
        return any(e.finish_reason for e in self.events[request_id])

    def wait_all(self, request_ids: list[str], timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while not all(self.finished(r) for r in request_ids):
            if time.time() > deadline:
                raise TimeoutError("requests did not finish")
            self.pump()

    def tokens(self, request_id: str) -> list[int]:
        """Output tokens in order, duplicates dropped by index (as the real gateway does)."""
        out: list[int] = []
        for event in self.events[request_id]:
            for offset, token in enumerate(event.token_ids):
                if event.index + offset == len(out):
                    out.append(token)
        return out


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir, redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    procs = [start_worker("prefill_worker", tiny_model_dir, redis_url, "--max-num-batched-tokens", "32"),
             start_worker("decode_worker", tiny_model_dir, redis_url, "--num-kv-blocks", "64")]
    try:
        wait_heartbeats(client, ["prefill", "decode"])
        yield client, procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        client.close()


@pytest.fixture(scope="module")
def reference_llm(tiny_model_dir):
    from baton import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)


PROMPTS = [[5, 6, 7], list(range(100, 140)), list(range(300, 333)), [42] * 70, list(range(1000, 1016))]


def test_handoff_matches_colocated_engine(pipeline, reference_llm):
    from baton import SamplingParams

    client, _ = pipeline
    gateway = Gateway(client)
    ids = [gateway.submit(p, 24, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    gateway.wait_all(ids)
    expected = [o.outputs[0].token_ids for o in reference_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    assert [gateway.tokens(r) for r in ids] == expected
    assert all(gateway.events[r][-1].finish_reason == "length" for r in ids)
    # the first token came from the prefill worker, the rest from the decode worker
    assert all(gateway.events[r][0].worker_id.startswith("prefill") for r in ids)
    assert all(gateway.events[r][-1].worker_id.startswith("decode") for r in ids)


def test_seeded_sampling_is_reproducible_across_processes(pipeline, reference_llm):
    from baton import SamplingParams

    client, _ = pipeline
    gateway = Gateway(client)
    rid = gateway.submit(PROMPTS[1], 16, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    gateway.wait_all([rid])
    local = reference_llm.generate([PROMPTS[1]], SamplingParams(temperature=0.8, top_p=0.9, seed=1234,
                                                                max_tokens=16, ignore_eos=True))
    assert gateway.tokens(rid) == local[0].outputs[0].token_ids


def test_shared_prefix_blocks_are_fetched_not_recomputed(pipeline, tiny_model_dir):
    from baton.model.config import ModelConfig
    from kvstore.hashing import hash_blocks

    client, _ = pipeline
    gateway = Gateway(client)
    prefix = list(range(2000, 2048))  # three full blocks
    first = gateway.submit(prefix + [7, 8], 2, temperature=0.0)
    gateway.wait_all([first])
    model_id = ModelConfig.from_dir(tiny_model_dir).model_id
    assert all(client.exists(f"baton:kv:{h}") for h in hash_blocks(prefix, 16, model_id))
    second = gateway.submit(prefix + [9, 10, 11], 2, temperature=0.0)
    gateway.wait_all([second])
    assert gateway.events[first][0].num_cached_tokens == 0
    assert gateway.events[second][0].num_cached_tokens == 48


def test_cancel_frees_everything(pipeline):
    client, _ = pipeline
    gateway = Gateway(client)
    rid = gateway.submit(PROMPTS[1], 1500, temperature=0.0, ignore_eos=True)
    deadline = time.time() + 60
    while len(gateway.tokens(rid)) < 3 and time.time() < deadline:
        gateway.pump()
    gateway.cancel(rid)
    time.sleep(1.5)
    gateway.pump()
    count = len(gateway.tokens(rid))
    time.sleep(1.0)
    gateway.pump()
    assert len(gateway.tokens(rid)) - count <= 1  # generation stopped
    assert not gateway.finished(rid) or gateway.events[rid][-1].finish_reason != "length"
    wait_for_idle(client)


def wait_for_idle(client: redis.Redis, timeout: float = 20) -> None:
    import msgpack

    deadline = time.time() + timeout
    while time.time() < deadline:
        states = [msgpack.unpackb(v) for _k, v in heartbeats.live_sync(client, "decode")]
        if states and all(s["num_kv_blocks_used"] == 0 and s["num_requests_running"] == 0 for s in states):
            pending = client.xpending(protocol.DECODE_STREAM, protocol.DECODE_GROUP)["pending"]
            if pending == 0:
                return
        time.sleep(0.3)
    raise AssertionError(f"decode workers not idle: {states}")


def test_malformed_message_goes_to_dead_letter(pipeline):
    client, procs = pipeline
    client.xadd(protocol.PREFILL_STREAM, {protocol.PAYLOAD_FIELD: b"\xc1not msgpack"})
    client.xadd(protocol.DECODE_STREAM, {b"other": b"field"})
    deadline = time.time() + 20
    while client.xlen(protocol.DEAD_LETTER_STREAM) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert client.xlen(protocol.DEAD_LETTER_STREAM) >= 2
    assert all(p.poll() is None for p in procs)  # nobody crashed
    # and the workers still serve
    gateway = Gateway(client)
    rid = gateway.submit([1, 2, 3], 4, temperature=0.0, ignore_eos=True)
    gateway.wait_all([rid])
    assert len(gateway.tokens(rid)) == 4
