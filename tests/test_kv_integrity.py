"""Issue 20 (6): a KV block in the store that is not what this model's blocks look like (shape, dtype,
byte length) is a cache miss, counted and logged once, never a crash. Anyone who can write to Redis
can pre-write `baton:kv:<hash>` for a popular prefix (SET NX: the first write wins), so a worker
must not trust a block's layout any more than its tokens.

Real workers over the private Redis; the test plays the gateway (tests/test_workers.py's helper).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import urllib.request

import msgpack
import pytest
import redis
import torch

from baton.cli.redis_server import free_port
from baton.engine.kv_types import BlockLoad, KVLoad
from baton.worker.kv_transfer import StoreKVTransfer
from kvstore.codec import decode_block, decode_state, encode_block, encode_state
from kvstore.keys import block_key, partial_key, state_key
from kvstore.memory_backend import InMemoryBlockStore
from tests.test_gateway_support import wait_until
from tests.test_workers import Gateway, wait_heartbeats

BLOCK_SIZE = 16
REJECTED = "baton:worker_kv_blocks_rejected_total"


def _layout(model_dir) -> list[int]:
    from baton.model.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    return [config.num_layers, 2, BLOCK_SIZE, config.num_kv_heads, config.head_dim]


def _healed(client: redis.Redis, key: str, tokens: list[int], shape: list[int]) -> bool:
    """Whether `key` now holds a well-formed block of `tokens` in this model's layout."""
    value = client.get(key)
    if value is None:
        return False
    try:
        stored, kv = decode_block(value)
    except ValueError:
        return False
    return stored == tokens and list(kv.shape) == shape


def malformed_block(kind: str, tokens: list[int], shape: list[int]) -> bytes:
    """A value that decodes as a Baton block holding `tokens`, but of the wrong layout."""
    if kind == "shape":  # self-consistent bytes, one head too many
        return encode_block(tokens, torch.ones([*shape[:3], shape[3] + 1, shape[4]]))
    if kind == "dtype":  # the right shape, integers
        return encode_block(tokens, torch.ones(shape, dtype=torch.int32))
    if kind == "bytes":  # says float32 of the right shape, carries fewer bytes
        good = msgpack.unpackb(encode_block(tokens, torch.ones(shape)), raw=False)
        return msgpack.packb({**good, "data": good["data"][:-4]}, use_bin_type=True)
    if kind == "rank":  # a flat tensor of exactly the right number of elements
        return encode_block(tokens, torch.ones(shape).flatten())
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["shape", "dtype", "bytes", "rank"])
async def test_fetch_keeps_the_valid_prefix_and_counts_the_rejected_block(kind, caplog):
    shape = [2, 2, BLOCK_SIZE, 3, 8]
    tokens = [list(range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)) for i in range(3)]
    hashes = [f"{kind}-{i}" for i in range(3)]
    keys = [block_key(h) for h in hashes]
    store = InMemoryBlockStore()
    transfer = StoreKVTransfer(store, shape)
    load = KVLoad("req", tuple(BlockLoad(i, tuple(tokens[i]), hashes[i]) for i in range(3)))
    for attempt in range(2):
        store.values.update({keys[0]: encode_block(tokens[0], torch.ones(shape, dtype=torch.bfloat16)),
                             keys[1]: malformed_block(kind, tokens[1], shape),
                             keys[2]: encode_block(tokens[2], torch.ones(shape))})
        caplog.clear()
        with caplog.at_level(logging.WARNING, "baton.kv_connector"):
            result = await transfer.load(load)
        # the first block kept; the malformed one and the rest are computed instead
        assert result.num_tokens == BLOCK_SIZE and result.block_hashes == [hashes[0]]
        # the malformed block is deleted, so the block computed instead can be stored (SET NX)
        assert keys[1] not in store.values and keys[0] in store.values and keys[2] in store.values
        assert result.num_rejected == 1 and result.num_missing == 2
        assert [list(kv.shape) for kv in result.kv] == [shape]
        # logged once, with its key: a poisoned popular prefix is met by every request sharing it
        assert [keys[1] in r.getMessage() for r in caplog.records] == ([True] if attempt == 0 else [])


def test_a_state_round_trips_through_the_codec():
    """A hybrid's state (conv in the model's dtype, recurrent in fp32) comes back bit for bit, with
    the kind and the tokens it was computed over."""
    conv = torch.randn(3, 24, 3, dtype=torch.bfloat16)
    recurrent = torch.randn(3, 4, 8, 8)
    value = encode_state("gated_deltanet", [5, 6, 7], {"conv": conv, "recurrent": recurrent})
    kind, tokens, tensors = decode_state(value)
    assert (kind, tokens) == ("gated_deltanet", [5, 6, 7])
    assert tensors["conv"].dtype == torch.bfloat16 and torch.equal(tensors["conv"], conv)
    assert torch.equal(tensors["recurrent"], recurrent)
    good = msgpack.unpackb(encode_state("gated_deltanet", [5], {"conv": conv}), raw=False)
    good["tensors"]["conv"]["data"] = good["tensors"]["conv"]["data"][:-2]  # fewer bytes than it says
    with pytest.raises(ValueError, match="wrong number of bytes"):
        decode_state(msgpack.packb(good, use_bin_type=True))


STATE_LAYOUT = {"conv": ([2, 24, 3], torch.float32), "recurrent": ([2, 4, 8, 8], torch.float32)}


@pytest.mark.parametrize("case", ["whole", "shape", "dtype", "kind", "tokens", "absent", "block missing"])
async def test_a_handed_off_state_loads_with_all_its_blocks_or_nothing(case, caplog):
    """A load with a state (a hybrid's handoff) gets every block and the state, or nothing (the
    decode worker then recomputes the prompt): a state of another shape, dtype, kind or tokens is a
    miss, counted, and deleted; never a crash, never blocks without their state."""
    shape = [2, 2, BLOCK_SIZE, 3, 8]
    prompt = list(range(BLOCK_SIZE + 5))
    full, tail = prompt[:BLOCK_SIZE], prompt[BLOCK_SIZE:]
    state = {name: torch.randn(s, dtype=d) for name, (s, d) in STATE_LAYOUT.items()}
    kind = "gated_deltanet"
    if case == "shape":
        state["recurrent"] = torch.randn(2, 4, 8, 4)
    elif case == "dtype":
        state["conv"] = state["conv"].to(torch.bfloat16)
    elif case == "kind":
        kind = "short_conv"
    store = InMemoryBlockStore()
    store.values.update({block_key("h0"): encode_block(full, torch.ones(shape)),
                         partial_key("req"): encode_block(tail, torch.ones([2, 2, BLOCK_SIZE, 3, 8]))})
    if case != "absent":
        store.values[state_key("req")] = encode_state(kind, prompt[:-1] if case == "tokens" else prompt, state)
    if case == "block missing":
        del store.values[partial_key("req")]
    transfer = StoreKVTransfer(store, shape, "gated_deltanet", STATE_LAYOUT)
    load = KVLoad("req", (BlockLoad(1, tuple(full), "h0"), BlockLoad(2, tuple(tail), None, partial_key("req"))),
                  state_key("req"), tuple(prompt))
    result = await transfer.load(load)
    if case == "whole":
        assert result.num_tokens == len(prompt) and len(result.kv) == 2 and result.num_state_misses == 0
        assert all(torch.equal(result.state[n], state[n]) for n in state)
        return
    assert (result.num_tokens, result.kv, result.state, result.num_state_misses) == (0, [], None, 1)
    assert result.block_hashes == [] and result.num_missing == 2
    foreign = case in ("shape", "dtype", "kind", "tokens")
    assert result.num_rejected == int(foreign)
    assert (state_key("req") in store.values) == (case == "block missing")


def start_worker(module: str, model_dir, redis_url: str, log_path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, "--model", str(model_dir), "--redis-url", redis_url, "--threads", "1",
             "--dtype", "float32", "--claim-idle-ms", "1000", *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)


@pytest.fixture(scope="module")
def workers(tiny_model_dir, redis_url, tmp_path_factory):
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    logs = tmp_path_factory.mktemp("kv-integrity")
    ports = {"prefill": free_port(), "decode": free_port()}
    procs = {
        "prefill": start_worker("prefill_worker", tiny_model_dir, redis_url, logs / "prefill.log",
                                "--metrics-port", str(ports["prefill"])),
        "decode": start_worker("decode_worker", tiny_model_dir, redis_url, logs / "decode.log",
                               "--num-kv-blocks", "64", "--metrics-port", str(ports["decode"])),
    }
    try:
        wait_heartbeats(client, ["prefill", "decode"])
        yield client, procs, ports, logs
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        client.close()


def rejected(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(REJECTED + "{"))


@pytest.fixture(scope="module")
def reference_llm(tiny_model_dir):
    from baton import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)


@pytest.mark.parametrize("kind", ["shape", "dtype", "bytes"])
def test_a_malformed_block_in_the_store_is_a_counted_miss(workers, reference_llm, tiny_model_dir, kind):
    from baton import SamplingParams
    from baton.model.config import ModelConfig
    from kvstore.hashing import hash_blocks

    client, procs, ports, logs = workers
    gateway = Gateway(client)
    base = {"shape": 3000, "dtype": 4000, "bytes": 5000}[kind]
    first, second = list(range(base, base + 16)), list(range(base + 100, base + 116))
    prompt = first + second + [7, 8, 9]
    # The first block genuinely in the store (a request that shares it); the second poisoned.
    warm = gateway.submit(first + [1, 2], 2, temperature=0.0)
    gateway.wait_all([warm])
    model_id = ModelConfig.from_dir(tiny_model_dir).model_id
    hashes = hash_blocks(prompt, BLOCK_SIZE, model_id)
    assert client.exists(f"baton:kv:{hashes[0]}")
    key = f"baton:kv:{hashes[1]}"
    client.set(key, malformed_block(kind, second, _layout(tiny_model_dir)))
    before = {name: rejected(port) for name, port in ports.items()}

    expected = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    rid = gateway.submit(prompt, 8, temperature=0.0, ignore_eos=True)
    gateway.wait_all([rid], timeout=60)
    assert gateway.tokens(rid) == expected[0].outputs[0].token_ids
    assert gateway.events[rid][0].num_cached_tokens == BLOCK_SIZE  # the good block, not the bad one
    assert all(proc.poll() is None for proc in procs.values()), "a worker crashed"
    after = {name: rejected(port) for name, port in ports.items()}
    # The prefill worker finds both blocks by a probe; the handoff names both, so decode meets it too
    # (or finds it gone: the worker that rejects a block deletes it).
    assert after["prefill"] - before["prefill"] == 1
    assert after["decode"] - before["decode"] in (0, 1)
    assert wait_until(lambda: not client.exists(key))
    # Deleted, the key is free for the good block (full blocks are written SET NX: a poisoned key
    # kept them out until its TTL): the next request that shares the prefix computes and stores it.
    again = gateway.submit(prompt, 8, temperature=0.0, ignore_eos=True)
    gateway.wait_all([again], timeout=60)
    assert gateway.tokens(again) == expected[0].outputs[0].token_ids
    assert wait_until(lambda: _healed(client, key, second, _layout(tiny_model_dir)))
    for name, most in (("prefill", 1), ("decode", after["decode"] - before["decode"])):
        text = (logs / f"{name}.log").read_text()
        assert sum(key in line for line in text.splitlines()) == most, (name, text[-3000:])
