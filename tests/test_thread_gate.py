"""Lent threads given back between decode layers (baton/worker/ledger_gate.py behind baton/model/thread_gate.py, decode_layers.cpp):
a decode step that borrowed a prefill worker's core lets it go at the next layer once the prefill
worker asks for it, with the same tokens, and a long step may borrow when only its ungated part is
short. The gate's words are a real core-share ledger file, mapped as the workers map it."""

from __future__ import annotations

import time

import pytest
import torch

from baton.model.layers_plan import LayersPlan
from baton.worker import thread_lending
from baton.worker.ledger_gate import LedgerGate
from baton.worker.thread_lending import (LEND_AFTER_S, MAX_BORROWING_STEP_S, Borrower, Ledger, LenderState,
                                         StepCores, run_with_threads)


@pytest.fixture
def ledger(tmp_path):
    return Ledger(thread_lending.create(tmp_path / "core-share", prefill_workers=1, decode_workers=1))


@pytest.fixture(scope="module")
def planned_llm(tiny_model_dir):
    """The tiny model with its projections quantized: the all-layers native call runs its decode
    steps on every CPU with the integer kernel (AVX2 or AVX512-VNNI)."""
    from baton.model import kernels
    from baton.llm import LLM

    native = kernels.load()
    if native is None or not native.q8_available():
        pytest.skip("no native integer kernel on this CPU")
    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", quantization="int8", num_kv_blocks=64,
              enable_prefix_caching=False)
    if llm.engine.runtime.model.layers_plan is None:
        pytest.skip("the all-layers decode call is not built on this CPU")
    return llm


def _greedy(n: int):
    from baton.common.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


PROMPTS = ["The capital of France is", "Écris un poème sur la mer", "数学は"]


class _ReclaimedDuringLayers(LedgerGate):
    """A gate whose owner asks for its cores back just after the step's look before the layers:
    only the native loop between layers can see it."""

    def enter(self) -> None:
        super().enter()
        for word in self.watch:
            self.words[word] = int(LenderState.BUSY)


def _spy_on_layers(model, seen: list[tuple[int, list[int]]], gate: LedgerGate) -> LayersPlan:
    plan = model.layers_plan

    class Spy:
        def decode_layers(self, *args):
            out = plan.kernel.decode_layers(*args)
            seen.append((torch.get_num_threads(), [int(gate.words[i]) for i in gate.release]))
            return out

    model.layers_plan = LayersPlan(**{**plan.__dict__, "kernel": Spy()})
    return plan


def _generate_on_threads(llm, threads: int, gate: LedgerGate | None, arm) -> list[list[int]]:
    """Greedy tokens of PROMPTS, each engine step run as a worker runs it: on `threads` threads,
    the gate armed before the step by `arm()`."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", llm.tokenizer(prompt)["input_ids"], _greedy(6))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        if gate is not None:
            arm()
        for out in run_with_threads(engine.step, threads=threads):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))]


def _run_gated(llm, gate: LedgerGate, arm) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """Greedy tokens of PROMPTS on 2 threads with `gate` installed, and for each all-layers call
    the thread count and the release words it left."""
    before = torch.get_num_threads()
    model = llm.engine.runtime.model
    seen: list[tuple[int, list[int]]] = []
    plan = _spy_on_layers(model, seen, gate)
    try:
        llm.engine.set_thread_gate(gate)
        tokens = _generate_on_threads(llm, 2, gate, arm)
    finally:
        model.layers_plan = plan
        llm.engine.set_thread_gate(None)
        torch.set_num_threads(before)
    return tokens, seen


def test_the_layers_give_lent_threads_back_once_the_lender_asks_with_the_same_tokens(planned_llm, ledger):
    lender, release = ledger.lender_state_word(0), ledger.borrowed_words(0)
    gate = _ReclaimedDuringLayers(ledger.words(), open_value=int(LenderState.LENDING))

    def arm() -> None:
        ledger.write_lender(0, LenderState.LENDING, 1, time.monotonic())
        ledger.write_borrowed(0, 0b1)
        gate.arm(watch=[lender], release=release, threads=1)

    gated, seen = _run_gated(planned_llm, gate, arm)
    plain = _generate_on_threads(planned_llm, 1, None, arm)
    assert gated == plain
    assert len(seen) >= 5  # every decode-only step (prompts of different lengths: a few more)
    # each one: the native loop dropped to the gate's 1 thread and cleared the borrower's record
    assert all(threads == 1 and words == [0, 0] for threads, words in seen)
    assert ledger.borrowed(0) == 0


def test_a_step_that_sees_the_lender_reclaiming_before_its_layers_runs_on_its_own_threads(planned_llm, ledger):
    gate = LedgerGate(ledger.words(), open_value=int(LenderState.LENDING))

    def arm() -> None:  # lent, then reclaimed before the step reaches its layers
        ledger.write_borrowed(0, 0b1)
        gate.arm(watch=[ledger.lender_state_word(0)], release=ledger.borrowed_words(0), threads=1)
        ledger.write_lender(0, LenderState.BUSY, 1, 0.0)

    _, seen = _run_gated(planned_llm, gate, arm)
    assert seen and all(threads == 1 and words == [0, 0] for threads, words in seen)
    assert gate.tail_threads == 1 and gate.gated_seconds > 0


def test_an_open_gate_keeps_the_lent_threads_for_the_whole_step(planned_llm, ledger):
    gate = LedgerGate(ledger.words(), open_value=int(LenderState.LENDING))

    def arm() -> None:
        ledger.write_lender(0, LenderState.LENDING, 1, time.monotonic())
        ledger.write_borrowed(0, 0b1)
        gate.arm(watch=[ledger.lender_state_word(0)], release=ledger.borrowed_words(0), threads=1)

    _, seen = _run_gated(planned_llm, gate, arm)
    assert seen and all(threads == 2 and words == [1, 0] for threads, words in seen)
    assert gate.tail_threads == 2


def test_a_long_step_borrows_when_its_ungated_part_is_short(ledger):
    from baton.worker.thread_lending import Lender

    lender = Lender(ledger, 0, threads=1)
    borrower = Borrower(ledger, 0)
    lender.lend()
    time.sleep(LEND_AFTER_S + 0.005)
    # the ungated part, measured on 1 thread, would take half as long on the 2 it borrows
    assert borrower.acquire(MAX_BORROWING_STEP_S * 1.8, last_ungated_threads=1) == 1
    assert borrower.borrowing == {0: 1}
    borrower.release()
    assert borrower.acquire(MAX_BORROWING_STEP_S * 2.2, last_ungated_threads=1) == 0
    assert borrower.acquire(MAX_BORROWING_STEP_S * 1.2, last_ungated_threads=2) == 0
    assert ledger.borrowed(0) == 0


def test_step_cores_arm_the_gate_for_a_borrowing_step_and_measure_its_ungated_part(ledger, tmp_path):
    prefill = StepCores("prefill", ledger, 0, threads=1)
    decode = StepCores("decode", Ledger(tmp_path / "core-share"), 0, threads=1)
    assert decode.gate is not None
    prefill.idle()
    time.sleep(LEND_AFTER_S + 0.005)
    import asyncio

    assert asyncio.run(decode.before_step()) == 2
    assert decode.gate.armed and decode.gate.threads == 1
    decode.gate.gated_seconds, decode.gate.tail_threads = 0.5, 2  # a long step, all but 10 ms in layers
    decode.after_step(0.51)
    assert not decode.gate.armed
    assert decode.last_ungated_seconds == pytest.approx(0.01) and decode.last_ungated_threads == 2
    assert asyncio.run(decode.before_step()) == 2  # so the next step borrows again
    decode.after_step(0.2)  # never entered its layers (a prefill chunk): all of it ungated, on 2 threads
    assert decode.last_ungated_seconds == pytest.approx(0.2)
    assert asyncio.run(decode.before_step()) == 1
    decode.after_step(0.01)
    prefill.close()
    decode.close()


class _ReclaimedAfterLayers(LedgerGate):
    """A gate whose owner asks for its cores back at its `after`-th look (`enter` looks once before
    the layers, the loop after each layer, `leave` once more)."""

    def __init__(self, *args, after: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.after, self.polls = after, 0
        self.steps: list[list[int]] = []  # per armed step, the thread count at each poll

    def poll(self) -> bool:
        self.polls += 1
        self.steps[-1].append(torch.get_num_threads())
        if self.polls == self.after and self.armed:
            for word in self.watch:
                self.words[word] = int(LenderState.BUSY)
        return super().poll()


def test_a_hybrid_models_layer_loop_gives_lent_threads_back_between_layers(ledger, tmp_path_factory,
                                                                          default_model_dir):
    """A hybrid model (Qwen3.5: no all-layers native call, a Python loop over its layers) polls the
    gate after each layer: a step that borrowed a core runs its first layer on 2 threads, gives the
    core back once the lender asks, and finishes on its own thread, with the borrower's record
    cleared and the same tokens as a step that never borrowed. (Without this a hybrid's whole step
    counted as ungated, over `MAX_BORROWING_STEP_S`, and its decode worker never borrowed.)"""
    from baton.llm import LLM
    from tests.test_hybrid import build_hybrid

    model_dir = build_hybrid("qwen3_5", tmp_path_factory.mktemp("gate-hybrid") / "qwen3_5", default_model_dir)
    llm = LLM(model=str(model_dir), dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    num_layers = len(llm.engine.runtime.model.layers)
    # asked back at the look after the first layer (the second: `enter` looks first)
    gate = _ReclaimedAfterLayers(ledger.words(), open_value=int(LenderState.LENDING), after=2)

    def arm() -> None:
        gate.polls = 0
        gate.steps.append([])
        ledger.write_lender(0, LenderState.LENDING, 1, time.monotonic())
        ledger.write_borrowed(0, 0b1)
        gate.arm(watch=[ledger.lender_state_word(0)], release=ledger.borrowed_words(0), threads=1)

    before = torch.get_num_threads()
    try:
        llm.engine.set_thread_gate(gate)
        gated = _generate_on_threads(llm, 2, gate, arm)
    finally:
        llm.engine.set_thread_gate(None)
        torch.set_num_threads(before)
    plain = _generate_on_threads(llm, 1, None, arm)
    assert gated == plain
    assert len(gate.steps) >= 6
    for polled in gate.steps:  # enter, each layer, leave: the first layer on the lent threads, the rest on its own
        assert polled == [2, 2] + [1] * num_layers, polled
    assert ledger.borrowed(0) == 0 and gate.tail_threads == 1
