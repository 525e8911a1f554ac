"""The worker cores without a Redis server: real engines (the tiny model), the real writer and block
store over kvstore's in-memory Redis. Handoff, KV loads (whole, partial, refused), preemption after
a load, cancel races, delivery caps and dead letters, each in milliseconds."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
from prometheus_client import CollectorRegistry

from baton.common import protocol
from baton.engine.llm_engine import EngineConfig, LLMEngine
from baton.llm import LLM
from baton.common.sampling_params import SamplingParams
from baton.engine.kv_types import LoadedKV
from baton.worker.core import Effects, Opening
from baton.worker.kv_transfer import StoreKVTransfer
from baton.worker.metrics import WorkerMetrics
from baton.worker.writer import write_effects
from decode_worker.core import DecodeCore
from kvstore.hashing import hash_blocks
from kvstore.keys import block_key
from kvstore.memory_backend import InMemoryBlockStore
from prefill_worker.core import PrefillCore

BS = 16
PROMPT = list(range(200, 253))  # 3 full blocks and a partial one of 5 tokens
N = 10


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enable_prefix_caching=False, num_kv_blocks=128)

    def run(prompt: list[int], max_tokens: int = N) -> list[int]:
        [out] = llm.generate(prompt, greedy(max_tokens))
        return out.outputs[0].token_ids

    return run


def greedy(max_tokens: int = N) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def engine(model_dir, num_kv_blocks: int = 64, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=BS,
                                  num_kv_blocks=num_kv_blocks, kv_connector=True, **kwargs))


def prefill_core(model_dir, **kwargs) -> PrefillCore:
    e = engine(model_dir, **kwargs)
    return PrefillCore(e, "prefill-test", WorkerMetrics("tiny", "prefill", CollectorRegistry()))


def decode_core(model_dir, **kwargs) -> DecodeCore:
    e = engine(model_dir, **kwargs)
    return DecodeCore(e, "decode-test", WorkerMetrics("tiny", "decode", CollectorRegistry()))


def request(prompt: list[int], request_id: str = "r1", max_tokens: int = N) -> protocol.PrefillRequest:
    return protocol.PrefillRequest(request_id, "gw", prompt, greedy(max_tokens), time.time())


def fields_of(message) -> dict:
    return {protocol.PAYLOAD_FIELD: protocol.encode(message)}


def new_store() -> InMemoryBlockStore:
    store = InMemoryBlockStore()
    store.redis.streams[protocol.token_stream("gw")] = []  # the gateway makes its stream
    return store


def write(core, store: InMemoryBlockStore, effects: Effects) -> None:
    """What the core's shell does with its effects: the real writer, on the in-memory Redis."""
    stream, group = ((protocol.PREFILL_STREAM, protocol.PREFILL_GROUP) if core.kind == "prefill"
                     else (protocol.DECODE_STREAM, protocol.DECODE_GROUP))
    asyncio.run(write_effects(store.redis, effects, stream, group, transaction=True, store=store))


def fetch_loads(core, store: InMemoryBlockStore) -> list[LoadedKV]:
    """Run the loads the last step asked for (their results go into the next step)."""
    transfer = StoreKVTransfer(store, core.engine.block_shape)
    return [asyncio.run(transfer.load(load)) for load in core.engine.take_kv_loads()]


def drive(core, store: InMemoryBlockStore, max_steps: int = 200,
          loaded: list[LoadedKV] | None = None) -> tuple[Effects, list[int]]:
    """Step the core's engine to the end, writing each step's effects; returns the merged effects
    and each step's token count."""
    effects, batched = Effects(), []
    for _ in range(max_steps):
        if not core.engine.has_unfinished():
            return effects, batched
        outputs = core.engine.step(loaded or [])
        loaded = fetch_loads(core, store)
        batched.append(core.engine.stats().num_batched_tokens)
        step_effects = core.on_step(outputs)
        write(core, store, step_effects)
        effects.extend(step_effects)
    raise AssertionError("the engine did not finish")


def prefill(model_dir, store: InMemoryBlockStore, prompt: list[int] = PROMPT, request_id: str = "r1",
            core: PrefillCore | None = None) -> tuple[Effects, protocol.Handoff, list[int]]:
    core = core or prefill_core(model_dir)
    req = request(prompt, request_id)
    opened = core.open(fields_of(req), 1, set())
    assert opened.outcome is Opening.ADMIT
    stored = asyncio.run(StoreKVTransfer(store).probe(hash_blocks(prompt, BS, core.engine.model_id)))
    assert not core.admit(b"1-0", opened.message, stored)
    effects, batched = drive(core, store)
    [handoff] = effects.handoffs
    return effects, handoff, batched


def load_handoff(decode, handoff: protocol.Handoff, store: InMemoryBlockStore) -> list[LoadedKV]:
    """Open and admit a handoff on a decode core, run the step that asks for its blocks (nothing to
    compute yet) and the loads: all of the prompt's KV came from the store."""
    opened = decode.open(fields_of(handoff), 1, set())
    assert opened.outcome is Opening.ADMIT
    decode.admit(b"9-0", opened.message)
    decode.engine.step()  # the schedule asks for the load; nothing to compute yet
    loaded = fetch_loads(decode, store)
    assert sum(r.num_tokens for r in loaded) == len(handoff.prompt_token_ids)
    return loaded


def events_of(effects: Effects) -> list[protocol.TokenEvent]:
    return [e for events in effects.events.values() for e in events]


def assert_pool_free(core) -> None:
    stats = core.engine.stats()
    assert stats.num_kv_blocks_used == 0 and not core.engine.has_unfinished()
    core.engine.pool.check_invariants()


def test_handoff_through_the_store_continues_exactly_where_prefill_stopped(tiny_model_dir, reference):
    store = new_store()
    effects, handoff, _ = prefill(tiny_model_dir, store)
    expected = reference(PROMPT)
    [first] = events_of(effects)
    assert (first.index, first.token_ids, first.finish_reason) == (0, expected[:1], None)
    assert len(handoff.block_hashes) == 3 and len(effects.block_puts) == 3
    assert handoff.partial_block_key in store.values and effects.acks == [b"1-0"]

    decode = decode_core(tiny_model_dir)
    loaded = load_handoff(decode, handoff, store)
    effects, batched = drive(decode, store, loaded=loaded)
    assert batched[0] == 1, "the prompt's KV came from the store: only the first token is computed"
    events = events_of(effects)
    assert [t for e in events for t in e.token_ids] == expected[1:]
    assert [e.index for e in events] == list(range(1, N))
    assert events[-1].finish_reason == "length"
    assert effects.acks == [b"9-0"] and effects.deletes == [handoff.partial_block_key]
    assert_pool_free(decode)


def test_a_gemma4_handoff_continues_exactly_where_prefill_stopped(default_model_dir, tmp_path):
    """Gemma 4's cache (each layer a view of its own head shape on a slice padded to the widest, the
    KV-shared layers without a slice: docs/design-decisions.md) hands off as any family's: the
    decode worker loads the prompt's blocks (past the 24-token window) and continues with the
    tokens of a colocated run (itself transformers' greedy: tests/test_families.py)."""
    from tests.test_families import build_family

    model_dir = build_family("gemma4_text", tmp_path / "gemma4", default_model_dir)
    llm = LLM(model=str(model_dir), dtype="float32", enable_prefix_caching=False, num_kv_blocks=64)
    [out] = llm.generate(PROMPT, greedy())
    expected = out.outputs[0].token_ids
    store = new_store()
    effects, handoff, _ = prefill(model_dir, store)
    assert [t for e in events_of(effects) for t in e.token_ids] == expected[:1] and len(handoff.block_hashes) == 3
    decode = decode_core(model_dir)
    assert list(decode.engine.block_shape) == [4, 2, BS, 2, 32]  # 4 of 6 layers cached, at the widest shape
    loaded = load_handoff(decode, handoff, store)
    effects, batched = drive(decode, store, loaded=loaded)
    assert batched[0] == 1, "the prompt's KV came from the store: only the first token is computed"
    assert [t for e in events_of(effects) for t in e.token_ids] == expected[1:]
    assert_pool_free(decode)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_speculating_decode_worker_continues_a_handoff_exactly(tiny_model_dir, reference, method):
    """The decode side drafts over KV it loaded from the store (the draft model computes its own
    KV of the prompt first): the tokens are the plain ones, and verify steps did happen."""
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1} if method == "ngram" else
            {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 4})
    prompt = PROMPT[:8] * 4  # repetitive: the n-gram lookup finds what to propose
    store = new_store()
    _, handoff, _ = prefill(tiny_model_dir, store, prompt)
    decode = decode_core(tiny_model_dir, speculative_config=spec)
    decode.engine.scheduler.speculator.costs.force = True
    loaded = load_handoff(decode, handoff, store)
    effects, _ = drive(decode, store, loaded=loaded)
    assert [t for e in events_of(effects) for t in e.token_ids] == reference(prompt)[1:]
    stats = decode.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats
    assert_pool_free(decode)


def test_the_writer_leaves_in_redis_the_first_token_the_blocks_the_handoff_and_the_acks(tiny_model_dir, reference):
    """What the gateway and a decode worker find after the real writer ran the cores' effects: the
    first token in the gateway's stream, the blocks with their TTL, the handoff on the decode stream,
    the prompt acked; after decode, its tokens, its ack, and the partial block gone."""
    store = new_store()
    _, handoff, _ = prefill(tiny_model_dir, store)
    redis, expected = store.redis, reference(PROMPT)
    [(_, fields)] = redis.streams[protocol.DECODE_STREAM]
    assert protocol.decode(fields[protocol.PAYLOAD_FIELD], protocol.Handoff) == handoff
    assert redis.acked[(protocol.PREFILL_STREAM, protocol.PREFILL_GROUP)] == [b"1-0"]
    [(_, fields)] = redis.streams[protocol.token_stream("gw")]
    [event] = protocol.decode(fields[protocol.PAYLOAD_FIELD], protocol.TokenBatch).events
    assert (event.request_id, event.token_ids) == ("r1", expected[:1])
    assert all(redis.ttls[block_key(h)] == store.ttl_s for h in handoff.block_hashes)
    assert handoff.partial_block_key in redis.values

    decode = decode_core(tiny_model_dir)
    decode.admit(b"9-0", handoff)
    drive(decode, store)
    batches = [protocol.decode(f[protocol.PAYLOAD_FIELD], protocol.TokenBatch) for _, f in
               redis.streams[protocol.token_stream("gw")][1:]]
    assert [t for b in batches for e in b.events for t in e.token_ids] == expected[1:]
    assert redis.acked[(protocol.DECODE_STREAM, protocol.DECODE_GROUP)] == [b"9-0"]
    assert handoff.partial_block_key not in redis.values


def test_the_handoff_carries_the_prompts_block_ids(tiny_model_dir):
    store = new_store()
    core = prefill_core(tiny_model_dir)
    _, handoff, _ = prefill(tiny_model_dir, store, core=core)
    assert handoff.block_hashes == hash_blocks(PROMPT, BS, core.engine.model_id)
    assert all(block_key(h) in store.values for h in handoff.block_hashes)
    assert_pool_free(core)


@pytest.mark.parametrize("damage", ["missing", "foreign", "garbage"])
def test_a_damaged_block_ends_the_load_and_the_rest_is_computed(tiny_model_dir, reference, damage):
    store = new_store()
    _, handoff, _ = prefill(tiny_model_dir, store)
    second = block_key(handoff.block_hashes[1])
    if damage == "missing":
        del store.values[second]
    elif damage == "foreign":  # another block's tokens under this id: never trusted
        store.values[second] = store.values[block_key(handoff.block_hashes[0])]
    else:
        store.values[second] = msgpack.packb({"v": 99})
    decode = decode_core(tiny_model_dir)
    decode.admit(b"9-0", handoff)
    decode.engine.step()
    loaded = fetch_loads(decode, store)
    assert sum(r.num_tokens for r in loaded) == BS  # only the block before the damaged one
    effects, batched = drive(decode, store, loaded=loaded)
    assert batched[0] == len(PROMPT) + 1 - BS
    assert [t for e in events_of(effects) for t in e.token_ids] == reference(PROMPT)[1:]
    assert_pool_free(decode)


def test_a_prefill_worker_loads_a_prefix_another_one_stored(tiny_model_dir, reference):
    store = new_store()
    prefill(tiny_model_dir, store, PROMPT, "first")
    longer = PROMPT[:48] + list(range(900, 930))  # shares the 3 full blocks
    _, handoff, batched = prefill(tiny_model_dir, store, longer, "second")  # a fresh worker: cold local cache
    # the first step only schedules the load of the shared blocks; the next computes the rest
    assert batched[:2] == [0, len(longer) - 48], "the shared blocks were loaded, not computed"
    assert handoff.output_token_ids == reference(longer)[:1]


def test_cancel_while_loading_frees_the_blocks_and_drops_the_load(tiny_model_dir):
    store = new_store()
    _, handoff, _ = prefill(tiny_model_dir, store)
    decode = decode_core(tiny_model_dir)
    decode.admit(b"9-0", handoff)
    decode.engine.step()
    loaded = fetch_loads(decode, store)
    assert decode.engine.stats().num_requests_loading_kv == 1
    effects = decode.drop("r1", "cancelled")
    assert effects.acks == [b"9-0"] and effects.deletes == [handoff.partial_block_key]
    # The load comes back after the cancel: its blocks may already be someone else's; nothing is written.
    assert decode.engine.step(loaded) == []
    assert_pool_free(decode)
    assert decode.drop("r1", "cancelled") == Effects()  # a second cancel is a no-op


def test_preempted_requests_reload_and_resume_without_resending(tiny_model_dir, reference):
    store = new_store()
    prompts = [list(range(100 + 60 * i, 140 + 60 * i)) for i in range(3)]
    handoffs = [prefill(tiny_model_dir, store, p, f"r{i}")[1] for i, p in enumerate(prompts)]
    # 3 requests of 40 prompt tokens growing to 40+24: 12 blocks at the end, the pool has 10
    decode = decode_core(tiny_model_dir, num_kv_blocks=11)
    for i, handoff in enumerate(handoffs):
        handoff.sampling.max_tokens = 24
        decode.admit(f"{i}-0".encode(), handoff)
    effects, _ = drive(decode, store)
    assert decode.engine.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        events = effects.events["gw"]
        mine = [e for e in events if e.request_id == f"r{i}"]
        assert [e.index for e in mine] == list(range(1, 24)), "no token sent twice, none skipped"
        assert [t for e in mine for t in e.token_ids] == reference(prompt, 24)[1:]
    assert sorted(effects.acks) == [b"0-0", b"1-0", b"2-0"]
    assert_pool_free(decode)


def test_a_handoff_that_can_never_fit_ends_with_an_error(tiny_model_dir):
    store = new_store()
    _, handoff, _ = prefill(tiny_model_dir, store)
    decode = decode_core(tiny_model_dir, num_kv_blocks=3)  # 2 usable blocks: the prompt needs 4
    decode.admit(b"9-0", handoff)
    effects, _ = drive(decode, store)
    [event] = events_of(effects)
    assert event.finish_reason == "error" and "KV pool" in event.error
    assert effects.acks == [b"9-0"]
    assert_pool_free(decode)


def test_the_opening_dead_letters_skips_and_caps(tiny_model_dir):
    store = new_store()
    _, handoff, _ = prefill(tiny_model_dir, store)
    decode = decode_core(tiny_model_dir)
    bad = {protocol.PAYLOAD_FIELD: b"\x93not a map"}
    opened = decode.open(bad, 1, set())
    assert opened.outcome is Opening.DEAD_LETTER
    effects = decode.opening_effects(b"1-0", bad, opened)
    assert effects.dead_letters == [(b"1-0", bad, opened.error)] and not effects.acks
    # a prefill request on the decode stream is also malformed there
    assert decode.open(fields_of(request(PROMPT)), 1, set()).outcome is Opening.DEAD_LETTER
    assert decode.open(fields_of(handoff), 1, {"r1"}).outcome is Opening.SKIP  # cancelled before arrival
    opened = decode.open(fields_of(handoff), 5, set())  # delivered 5 times: it crashed 4 workers
    assert opened.outcome is Opening.FAIL
    effects = decode.opening_effects(b"2-0", fields_of(handoff), opened)
    [event] = events_of(effects)
    assert (event.finish_reason, event.index, effects.acks) == ("error", 1, [b"2-0"])
    assert "4 attempts" in event.error
    decode.admit(b"3-0", handoff)
    assert decode.open(fields_of(handoff), 1, set()).outcome is Opening.SKIP  # already decoding here


def test_a_block_the_store_dropped_is_written_again_and_the_others_kept_alive(tiny_model_dir):
    # Issue 11 (2i): a prefill worker remembered what it had stored and never wrote it again, so
    # once Redis dropped a block (TTL, eviction, restart) every later handoff missed it.
    store = new_store()
    core = prefill_core(tiny_model_dir)
    first, handoff, _ = prefill(tiny_model_dir, store, core=core, request_id="first")
    hashes = handoff.block_hashes
    del store.values[block_key(hashes[1])]
    second, handoff, _ = prefill(tiny_model_dir, store, core=core, request_id="second")
    assert [h for h, _ in second.block_puts] == hashes[1:]  # block 1 and the one chained after the gap
    assert second.block_refreshes == hashes[:1]  # still stored: only its TTL is refreshed
    assert all(block_key(h) in store.values for h in hashes)
