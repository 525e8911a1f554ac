"""The iteration-level scheduler, driven without a model.

`Sim` plays the model: after each `schedule()` it samples a token for every request whose tokens are
all computed and applies the step with the scheduler's own `update_from_output` (which advances
the counts, registers full blocks and finishes the requests that reached `max_tokens`). A request's i-th output token is a fixed function of (request,
i), so a request that was preempted and recomputed must end with exactly the expected tokens.
"""

from __future__ import annotations

import logging

import pytest

from baton.engine.block_manager import BlockManager
from baton.common.sampling_params import SamplingParams
from baton.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from baton.engine.sequence import Sequence, SequenceStatus
from baton.engine.block_pool import BlockPool
from baton.engine.kv_connector import KVConnectorScheduler
from baton.engine.kv_types import RemoteKV
from kvstore.hashing import hash_blocks


def out_token(seq_id: str, index: int) -> int:
    return 40000 + 1000 * (sum(map(ord, seq_id)) % 9) + index


class Sim:
    def __init__(self, num_blocks: int, block_size: int = 4, max_num_seqs: int = 64, budget: int = 512,
                 policy: str = "max-utilization", max_model_len: int = 1024) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.bm = BlockManager(self.pool, "test-model")
        self.config = SchedulerConfig(max_num_seqs, budget, policy, max_model_len)
        self.connector = KVConnectorScheduler(block_size, "test-model")
        self.sched = Scheduler(self.config, self.bm, connector=self.connector)
        self.seqs: dict[str, Sequence] = {}
        self.steps: list[SchedulerOutput] = []
        # outputs each request had when it was preempted, in order
        self.preempted_at: dict[str, list[int]] = {}

    def add(self, seq_id: str, prompt_len: int, max_tokens: int) -> Sequence:
        base = 100 * (len(self.seqs) + 1)
        seq = Sequence(seq_id, [base + i for i in range(prompt_len)],
                       SamplingParams(max_tokens=max_tokens, temperature=0))
        self.sched.add(seq)
        self.seqs[seq_id] = seq
        return seq

    def step(self) -> list[tuple[str, int]]:
        out = self.sched.schedule()
        self.steps.append(out)
        self._check(out)
        for seq in out.preempted:
            self.preempted_at.setdefault(seq.seq_id, []).append(seq.num_output_tokens)
        # The model: every request whose tokens are all computed after this step gets one more.
        sampled = [seq for seq, n in out.scheduled if seq.num_computed_tokens + n == seq.num_tokens]
        tokens = [out_token(seq.seq_id, seq.num_output_tokens) for seq in sampled]
        self.sched.update_from_output(out, sampled, tokens, [0.0] * len(tokens))  # the engine's real step
        self.pool.check_invariants()
        return [(seq.seq_id, n) for seq, n in out.scheduled]

    def _check(self, out: SchedulerOutput) -> None:
        sched = self.sched
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(sched.running) <= self.config.max_num_seqs
        ids = [seq.seq_id for seq, _ in out.scheduled]
        assert len(ids) == len(set(ids))
        sizes = [n for _, n in out.scheduled]
        assert all(n > 0 for n in sizes)
        assert sizes == sorted(sizes, key=lambda n: n != 1), "decode entries must come first"
        for seq, n in out.scheduled:
            assert seq in sched.running and seq.status is SequenceStatus.RUNNING
            # every scheduled token has a slot
            assert len(seq.block_table) * self.pool.block_size >= seq.num_computed_tokens + n
        for seq in out.preempted:
            assert seq not in sched.running and seq in sched.waiting
            assert seq.status is SequenceStatus.WAITING and seq.block_table == []
            assert seq.num_computed_tokens == 0
        held = sum(len(s.block_table) for s in sched.running)
        assert self.pool.num_used_blocks <= held  # only running requests hold blocks
        for seq in sched.waiting:
            assert seq.block_table == []

    def run(self, max_steps: int = 2000) -> int:
        steps = 0
        while self.sched.has_work():
            scheduled = self.step()
            assert scheduled, f"nothing scheduled: waiting={list(self.sched.waiting)}"
            steps += 1
            assert steps < max_steps, "no progress"
        return steps

    def assert_all_done(self) -> None:
        for seq in self.seqs.values():
            assert seq.is_finished and seq.finish_reason == "length", seq
            n = seq.sampling_params.max_tokens
            assert seq.output_token_ids == [out_token(seq.seq_id, i) for i in range(n)], seq
            assert seq.block_table == []
        assert self.pool.num_free_blocks == self.pool.num_blocks - 1
        assert all(count == 0 for count in self.pool.ref_counts)
        assert not self.sched.running and not self.sched.waiting

    def assert_no_thrash(self, max_per_request: int = 2) -> None:
        for seq_id, outputs in self.preempted_at.items():
            assert len(outputs) <= max_per_request, (seq_id, outputs)
            # between two preemptions a resumed request has produced at least one token
            assert all(later > earlier for earlier, later in zip(outputs, outputs[1:])), (seq_id, outputs)


# ------------------------------------------------------------------ admission

def test_fifo_admission_respects_max_num_seqs():
    sim = Sim(num_blocks=64, max_num_seqs=2)
    sim.add("a", 4, 2)
    sim.add("b", 4, 5)
    sim.add("c", 4, 3)
    sim.add("d", 4, 1)
    assert sim.step() == [("a", 4), ("b", 4)]
    assert [s.seq_id for s in sim.sched.waiting] == ["c", "d"]
    assert sim.step() == [("a", 1), ("b", 1)]
    assert sim.seqs["a"].is_finished
    assert sim.step() == [("b", 1), ("c", 4)]  # c, not d: strict arrival order
    assert sim.step() == [("b", 1), ("c", 1)]
    assert sim.step() == [("b", 1), ("c", 1)]
    assert sim.step() == [("d", 4)]
    assert not sim.sched.has_work()
    sim.assert_all_done()


def test_head_of_queue_that_does_not_fit_blocks_later_requests():
    sim = Sim(num_blocks=8, max_num_seqs=8)  # 7 usable blocks of 4 tokens
    sim.add("big1", 16, 4)   # 4 blocks
    sim.add("big2", 16, 4)   # 4 more: does not fit next to big1
    sim.add("small", 1, 1)   # would fit, but must not overtake big2
    assert sim.step() == [("big1", 16)]
    assert [s.seq_id for s in sim.sched.waiting] == ["big2", "small"]
    while not sim.seqs["big1"].is_finished:
        assert [seq_id for seq_id, _ in sim.step()] == ["big1"]
    assert sim.step() == [("small", 1), ("big2", 16)]  # admitted in order; one-token entry first
    sim.run()
    sim.assert_all_done()


def test_add_rejects_prompts_at_the_model_length():
    sim = Sim(num_blocks=16, max_model_len=16)
    with pytest.raises(ValueError, match="16 tokens"):
        sim.add("x", 16, 1)
    sim.add("y", 15, 1)
    assert sim.run() == 1
    sim.assert_all_done()


def test_scheduler_config_validation():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="fcfs")
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)


# ------------------------------------------------------------------ token budget, chunked prefill

def test_long_prompt_is_chunked_under_the_token_budget():
    sim = Sim(num_blocks=64, budget=16)
    seq = sim.add("long", 40, 3)
    sizes, outputs = [], []
    while sim.sched.has_work():
        [(_, n)] = sim.step()
        sizes.append(n)
        outputs.append(seq.num_output_tokens)
    assert sizes == [16, 16, 8, 1, 1]
    assert outputs == [0, 0, 1, 2, 3]  # the first token comes with the last chunk
    sim.assert_all_done()


def test_decode_and_prefill_chunks_share_the_budget():
    sim = Sim(num_blocks=64, budget=16)
    sim.add("a", 10, 10)
    sim.add("b", 40, 2)
    assert sim.step() == [("a", 10), ("b", 6)]
    assert sim.step() == [("a", 1), ("b", 15)]
    assert sim.step() == [("a", 1), ("b", 15)]
    assert sim.step() == [("a", 1), ("b", 4)]
    assert sim.step() == [("a", 1), ("b", 1)]
    assert sim.seqs["b"].is_finished
    sim.run()
    sim.assert_all_done()
    assert all(out.num_batched_tokens <= 16 for out in sim.steps)


def test_decode_entries_come_first():
    sim = Sim(num_blocks=64, budget=5)
    sim.add("a", 4, 3)
    sim.add("b", 10, 2)
    # b gets the one token left: a one-token entry, listed first with the decodes
    assert sim.step() == [("b", 1), ("a", 4)]
    assert sim.step() == [("a", 1), ("b", 4)]
    assert sim.step() == [("a", 1), ("b", 4)]
    assert sim.step() == [("b", 1)]
    sim.run()
    sim.assert_all_done()


def test_chunked_prefill_reserves_the_whole_prompt_on_admission():
    """Regression: a request admitted for its first chunk must not be starved of blocks for the
    next chunk by older requests' growth (it used to preempt itself and redo the chunk)."""
    sim = Sim(num_blocks=8, block_size=4, budget=8)  # 7 usable blocks
    sim.add("old", 8, 12)
    assert sim.step() == [("old", 8)]
    seq = sim.add("new", 16, 1)
    assert sim.step() == [("old", 1), ("new", 7)]
    assert seq.block_table == [4, 5, 6, 7]  # all four prompt blocks, though 7 tokens ran
    sim.run()
    sim.assert_all_done()
    assert sim.sched.num_preemptions == 0


# ------------------------------------------------------------------ preemption

def test_max_utilization_preempts_the_newest_running_request(caplog):
    sim = Sim(num_blocks=7, block_size=4)  # 6 usable; each request grows to 3 blocks
    for seq_id in ("req-a", "req-b", "req-c"):
        sim.add(seq_id, 4, 8)
    assert sim.step() == [("req-a", 4), ("req-b", 4), ("req-c", 4)]
    sim.add("req-d", 4, 1)  # arrives later: it waits behind the running requests
    with caplog.at_level(logging.WARNING, logger="baton.engine.scheduler"):
        for _ in range(4):
            sim.step()
            assert not sim.steps[-1].preempted
        assert sim.pool.num_free_blocks == 0
        c = sim.seqs["req-c"]
        assert c.block_table == [3, 6]
        scheduled = sim.step()  # a and b each need a new block: c, the newest, gives way
    out = sim.steps[-1]
    assert out.preempted == [c]
    assert scheduled == [("req-a", 1), ("req-b", 1)]
    assert [s.seq_id for s in sim.sched.waiting] == ["req-c", "req-d"]  # at the head
    assert [s.seq_id for s in sim.sched.running] == ["req-a", "req-b"]
    assert c.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert c.num_output_tokens == 5  # its generated tokens are kept for the recompute
    assert sim.seqs["req-a"].block_table == [1, 4, 6] and sim.seqs["req-b"].block_table == [2, 5, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "preempted request req-c" in warnings[0]

    sim.run()
    sim.assert_all_done()  # c finished with all 8 of its tokens, none lost or repeated
    assert c.num_preemptions == 1
    assert sim.sched.num_preemptions == 1


def test_preempted_request_resumes_from_its_cached_prefix():
    sim = Sim(num_blocks=9, block_size=4)  # 8 usable
    for seq_id in ("a", "b", "c"):
        sim.add(seq_id, 8, 5)  # 2 prompt blocks each, 3 at the end
    assert sim.step() == [("a", 8), ("b", 8), ("c", 8)]
    c = sim.seqs["c"]
    assert c.block_table == [5, 6]
    assert sim.step() == [("a", 1), ("b", 1)]  # c needed a block too: it preempted itself
    assert sim.steps[-1].preempted == [c]
    assert list(sim.pool.free_blocks) == [6, 5]  # its full prompt blocks stay cached
    while c not in sim.sched.running:  # it waits until a and b end and their blocks free up
        sim.step()
    assert sim.seqs["a"].is_finished and sim.seqs["b"].is_finished
    assert [(s.seq_id, n) for s, n in sim.steps[-1].scheduled] == [("c", 1)]  # 9 tokens, 8 cached
    assert c.num_cached_tokens == 8
    assert c.block_table[:2] == [5, 6]
    sim.run()
    sim.assert_all_done()


def test_no_evict_never_preempts_the_same_load():
    sim = Sim(num_blocks=7, block_size=4, policy="no-evict")
    for seq_id in ("req-a", "req-b", "req-c"):
        sim.add(seq_id, 4, 8)
    # each needs up to 3 blocks: only two fit with their whole future reserved
    assert sim.step() == [("req-a", 4), ("req-b", 4)]
    sim.run()
    sim.assert_all_done()
    assert sim.sched.num_preemptions == 0
    assert all(not out.preempted for out in sim.steps)


LOADS = [
    # (num_blocks, block_size, budget, max_num_seqs, [(prompt, max_tokens), ...])
    (7, 4, 512, 8, [(4, 8)] * 3),
    (7, 8, 8, 5, [(26, 5), (27, 13), (19, 10), (23, 16), (3, 3), (17, 2), (3, 8), (5, 2), (10, 1), (25, 15)]),
    (7, 8, 8, 2, [(10, 11), (21, 20), (7, 2), (11, 5), (11, 9), (16, 16), (20, 11)]),
    (10, 4, 4, 6, [(14, 4), (17, 8), (16, 10), (9, 13), (14, 16), (23, 2), (6, 17), (12, 7), (8, 5)]),
    (6, 8, 4, 8, [(12, 10), (22, 5)]),
    (12, 2, 4, 8, [(3, 19), (17, 2), (5, 15), (3, 10), (12, 5)]),
    (20, 4, 16, 4, [(30, 20), (1, 40), (17, 17), (9, 30), (40, 2), (2, 2)]),
]


@pytest.mark.parametrize("policy", ["max-utilization", "no-evict"])
@pytest.mark.parametrize("load", LOADS, ids=[f"load{i}" for i in range(len(LOADS))])
def test_every_request_finishes_and_the_pool_ends_all_free(load, policy):
    num_blocks, block_size, budget, max_num_seqs, requests = load
    sim = Sim(num_blocks, block_size, max_num_seqs, budget, policy)
    for index, (prompt_len, max_tokens) in enumerate(requests):
        sim.add(f"r{index}", prompt_len, max_tokens)
    sim.run()
    sim.assert_all_done()
    if policy == "no-evict":
        assert sim.sched.num_preemptions == 0
    else:
        sim.assert_no_thrash(max_per_request=2)


def test_the_tight_loads_do_preempt_under_max_utilization():
    """The loads above exercise preemption (else the no-thrash checks would prove nothing)."""
    preempting = 0
    for num_blocks, block_size, budget, max_num_seqs, requests in LOADS:
        sim = Sim(num_blocks, block_size, max_num_seqs, budget)
        for index, (prompt_len, max_tokens) in enumerate(requests):
            sim.add(f"r{index}", prompt_len, max_tokens)
        sim.run()
        preempting += sim.sched.num_preemptions > 0
    assert preempting >= 5


# ------------------------------------------------------------------ abort

def test_abort_running_and_waiting_requests_frees_their_blocks():
    sim = Sim(num_blocks=16, max_num_seqs=2)
    a = sim.add("a", 10, 5)
    b = sim.add("b", 6, 5)
    c = sim.add("c", 4, 5)
    sim.step()
    assert a.block_table == [1, 2, 3] and b.block_table == [4, 5]
    assert sim.sched.abort("a") is a
    assert a.is_finished and a.finish_reason == "cancelled" and a.block_table == []
    assert list(sim.pool.free_blocks)[-3:] == [3, 2, 1]
    assert sim.sched.running == [b]
    assert sim.sched.abort("c") is c
    assert c.is_finished and c.finish_reason == "cancelled"
    assert not sim.sched.waiting
    assert sim.sched.abort("a") is None
    assert sim.sched.abort("nope") is None
    sim.pool.check_invariants()
    while sim.sched.has_work():
        assert [seq_id for seq_id, _ in sim.step()] == ["b"]
    assert b.finish_reason == "length" and len(b.output_token_ids) == 5
    assert sim.pool.num_free_blocks == sim.pool.num_blocks - 1


def test_abort_of_a_preempted_request():
    sim = Sim(num_blocks=7, block_size=4)
    for seq_id in ("a", "b", "c"):
        sim.add(seq_id, 4, 8)
    while not sim.sched.num_preemptions:
        sim.step()
    c = sim.seqs["c"]
    assert c in sim.sched.waiting
    assert sim.sched.abort("c") is c and c.finish_reason == "cancelled"
    del sim.seqs["c"]
    sim.run()
    sim.assert_all_done()


# ------------------------------------------------------------------ KV from the store (the connector)
def remote(seq: Sequence, num_blocks: int, partial: int = 0) -> RemoteKV:
    hashes = hash_blocks(seq.token_ids, 4, "test-model")[:num_blocks]
    return RemoteKV(tuple(hashes), "partial-key" if partial else None, partial)


def test_stored_tokens_are_allocated_with_the_rest_and_the_request_waits_for_its_kv():
    sim = Sim(num_blocks=16)
    seq = sim.add("a", 12, 2)
    seq.remote_kv = remote(seq, 2)
    out = sim.sched.schedule()
    assert out.scheduled == [] and seq.status is SequenceStatus.WAITING_FOR_KV
    assert seq.block_table == [1, 2, 3]  # local + external tokens in one allocation
    [load] = out.kv_loads
    assert [(b.block_id, b.block_hash) for b in load.blocks] == list(zip([1, 2], seq.remote_kv.block_hashes))
    assert [list(b.token_ids) for b in load.blocks] == [seq.token_ids[0:4], seq.token_ids[4:8]]
    assert sim.sched.schedule().scheduled == []  # still loading: nothing to run, nothing failed
    assert sim.sched.finish_kv_load("a", 8) is seq
    assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == 8 and seq.num_cached_tokens == 8
    assert [sim.pool.block_hashes[b] is not None for b in seq.block_table] == [True, True, False]
    assert sim.step() == [("a", 4)]  # only the tokens the store did not have
    sim.run()
    sim.assert_all_done()


def test_a_partial_load_keeps_the_valid_prefix_and_computes_the_rest():
    sim = Sim(num_blocks=16)
    seq = sim.add("a", 14, 1)
    seq.remote_kv = remote(seq, 3, partial=1)  # 3 blocks + 1 token; at least one is left to compute
    [load] = sim.sched.schedule().kv_loads
    assert [len(b.token_ids) for b in load.blocks] == [4, 4, 4, 1] and load.blocks[-1].block_hash is None
    assert load.blocks[-1].partial_key == "partial-key"
    sim.sched.finish_kv_load("a", 4)  # only the first block arrived intact
    assert sim.step() == [("a", 10)]
    sim.assert_all_done()


def test_the_load_starts_after_the_local_prefix_cache_hits():
    sim = Sim(num_blocks=16)
    first = sim.add("a", 9, 1)
    sim.run()  # a's first two blocks are now in the local prefix cache
    seq = Sequence("b", first.prompt_token_ids[:8] + [7, 7, 7, 7, 7], SamplingParams(max_tokens=1))
    seq.remote_kv = remote(seq, 3)
    sim.sched.add(seq)
    sim.seqs["b"] = seq
    [load] = sim.sched.schedule().kv_loads
    assert seq.num_computed_tokens == 8 and len(load.blocks) == 1  # the third block only
    assert load.blocks[0].token_ids == (7, 7, 7, 7)
    sim.sched.finish_kv_load("b", 4)
    assert sim.step() == [("b", 1)]


def test_abort_while_loading_frees_the_blocks_and_refuses_the_late_result():
    sim = Sim(num_blocks=16)
    seq = sim.add("a", 12, 2)
    seq.remote_kv = remote(seq, 2)
    sim.sched.schedule()
    assert sim.sched.abort("a") is seq and seq.finish_reason == "cancelled"
    assert sim.sched.finish_kv_load("a", 8) is None
    assert sim.pool.num_free_blocks == 15 and not sim.sched.has_work()


def test_loading_requests_count_against_max_num_seqs_and_no_evict_reservations():
    sim = Sim(num_blocks=9, max_num_seqs=2, policy="no-evict")  # 8 usable blocks
    a = sim.add("a", 8, 8)  # reserves 4 blocks (16 tokens)
    a.remote_kv = remote(a, 1)
    sim.add("b", 8, 8)  # 4 more: fits beside a's reservation
    sim.add("c", 1, 1)
    out = sim.sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == ["b"] and len(out.kv_loads) == 1
    assert [s.seq_id for s in sim.sched.waiting] == ["c"]  # 2 admitted: max_num_seqs holds
    sim.sched.finish_kv_load("a", 4)
    sim.run()
    sim.assert_all_done()
    assert sim.sched.num_preemptions == 0


def test_a_request_larger_than_the_pool_fails_instead_of_blocking_the_queue():
    sim = Sim(num_blocks=4)  # 3 usable blocks of 4 tokens
    big = sim.add("big", 20, 1)
    sim.add("small", 3, 1)
    out = sim.sched.schedule()
    assert out.failed == [big] and big.finish_reason == "error" and big.block_table == []
    del sim.seqs["big"]
    sim.run()
    sim.assert_all_done()
