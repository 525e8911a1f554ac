"""Embeddings as one batched job (issue 38): the prefill core feeds a batch's inputs a short step at
a time, round robin and behind the chat prompts, and acks it once with its last vector; the gateway
admits it in its own lane, refuses by characters before tokenizing, and keeps the first copy of
each vector. (The real cluster's side is in test_embeddings.py.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from baton.common import protocol
from baton.common.finish_reason import FinishReason
from baton.common.sampling_params import SamplingParams
from tests.test_worker_core import assert_pool_free, events_of, fields_of, new_store, prefill_core, write
from baton.worker.core import Effects, Opening


def batch(request_id: str, inputs: list[list[int]], pooling: str = "mean") -> protocol.PrefillRequest:
    return protocol.PrefillRequest(request_id, "gw", [], SamplingParams(max_tokens=1), time.time(),
                                   pooling=pooling, inputs=inputs)


def step(core, store) -> Effects:
    """One turn of the prefill worker's loop without its I/O: feed, step, effects written."""
    effects = core.feed()
    effects.extend(core.on_step(core.engine.step([])))
    write(core, store, effects)
    return effects


def unpack(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<f4")


def vectors_of(effects: Effects, request_id: str) -> dict[int, bytes]:
    return {e.index: e.embedding for e in events_of(effects) if e.request_id == request_id and e.embedding}


INPUTS_A = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(12)]
INPUTS_B = [[500, 501, 502], [600, 601], [700, 701, 702, 703, 704]]


@pytest.fixture(scope="module")
def alone(tiny_model_dir, one_torch_thread) -> dict[tuple[int, ...], bytes]:
    """Each input's vector from a batch of its own."""
    core, store, out = prefill_core(tiny_model_dir), new_store(), {}
    for n, ids in enumerate(INPUTS_A + INPUTS_B):
        core.admit(f"{n}-0".encode(), batch(f"alone{n}", [ids]), [])
        while core.pooling or core.engine.has_unfinished():
            out.update({tuple(ids): v for v in vectors_of(step(core, store), f"alone{n}").values()})
    return out


def test_batches_take_turns_a_short_step_at_a_time_and_ack_once_at_their_end(tiny_model_dir, alone):
    core, store = prefill_core(tiny_model_dir, max_num_batched_tokens=64), new_store()
    core.pooling_step_tokens = 8  # two or three inputs a step
    assert not core.admit(b"1-0", batch("a", INPUTS_A), []) and not core.admit(b"2-0", batch("b", INPUTS_B), [])
    assert core.is_in_flight("a") and not core.engine.has_unfinished()  # nothing in the engine yet
    first = step(core, store)
    # one input of each batch in turn, within the step's 8 tokens; nothing acked yet
    assert sorted((e.request_id, e.index) for e in events_of(first)) == [("a", 0), ("b", 0)]
    assert not first.acks
    got: dict[str, dict[int, bytes]] = {"a": vectors_of(first, "a"), "b": vectors_of(first, "b")}
    acks, ends = [], []
    while core.pooling or core.engine.has_unfinished():
        effects = step(core, store)
        for name in got:
            got[name].update(vectors_of(effects, name))
        acks += effects.acks
        ends += [(e.request_id, e.index) for e in events_of(effects) if e.finish_reason is FinishReason.STOP]
    assert sorted(acks) == [b"1-0", b"2-0"]  # each message acked once, with its last vector
    assert sorted(ends) == [("a", 11), ("b", 2)]
    for name, inputs in (("a", INPUTS_A), ("b", INPUTS_B)):
        assert sorted(got[name]) == list(range(len(inputs)))
        for i, ids in enumerate(inputs):  # (batched with others, the float32 sums may round otherwise)
            assert np.allclose(unpack(got[name][i]), unpack(alone[tuple(ids)]), atol=1e-4), (name, i)
    assert_pool_free(core)


def test_a_chat_prompt_behind_a_big_batch_runs_in_the_next_step_alone(tiny_model_dir):
    from tests.test_worker_core import request

    core, store = prefill_core(tiny_model_dir, max_num_batched_tokens=64), new_store()
    core.pooling_step_tokens = 16
    core.admit(b"1-0", batch("big", [[100 + i, 7, 8, 9] for i in range(200)]), [])
    step(core, store)  # an embeddings step runs
    assert not core.admit(b"2-0", request([11, 12, 13, 14, 15, 16], "chat"), [])
    effects = step(core, store)
    [chat] = [e for e in events_of(effects) if e.request_id == "chat"]
    assert len(chat.token_ids) == 1 and len(effects.handoffs) == 1
    # the chat's step carried one embeddings input at most (the batch keeps moving)
    assert len(vectors_of(effects, "big")) <= 1 and core.engine.stats().num_batched_tokens <= 6 + 4
    assert "big" in core.pooling


def test_a_cancelled_batch_leaves_the_engine_and_is_acked(tiny_model_dir):
    core, store = prefill_core(tiny_model_dir), new_store()
    core.admit(b"1-0", batch("gone", [[100 + i, 5, 6] for i in range(40)]), [])
    step(core, store)
    core.feed()
    assert core.engine.has_unfinished()
    assert core.cancel("gone").acks == [b"1-0"]
    assert not core.pooling and not core.is_in_flight("gone") and not core.feed()
    assert_pool_free(core)


def test_an_input_the_engine_refuses_fails_the_batch_once(tiny_model_dir):
    core, store = prefill_core(tiny_model_dir), new_store()
    too_long = list(range(100, 100 + 5000))  # past the model's 2048 positions
    core.admit(b"1-0", batch("bad", [[100, 101], too_long, [102, 103]]), [])
    effects = Effects()
    while core.pooling or core.engine.has_unfinished():
        effects.extend(step(core, store))
    errors = [e for e in events_of(effects) if e.finish_reason is FinishReason.ERROR]
    assert len(errors) == 1 and "input 1" in errors[0].error and effects.acks == [b"1-0"]
    assert_pool_free(core)


def test_a_redelivered_batch_is_opened_and_run_again(tiny_model_dir):
    """A dead worker's batch, claimed by another: opened (its delivery count under the cap) and run
    whole; past the cap it ends with one error event."""
    core, store = prefill_core(tiny_model_dir), new_store()
    message = batch("again", INPUTS_B)
    opened = core.open(fields_of(message), 2, set())
    assert opened.outcome is Opening.ADMIT and opened.message.inputs == INPUTS_B
    core.admit(b"1-0", opened.message, [])
    effects = Effects()
    while core.pooling or core.engine.has_unfinished():
        effects.extend(step(core, store))
    assert sorted(vectors_of(effects, "again")) == [0, 1, 2] and effects.acks == [b"1-0"]
    failed = core.opening_effects(b"2-0", fields_of(message), core.open(fields_of(message), 4, set()))
    assert [e.finish_reason for e in events_of(failed)] == [FinishReason.ERROR] and failed.acks == [b"2-0"]


def test_the_wire_refuses_malformed_inputs():
    good = batch("r", [[1, 2], [3]])
    assert protocol.decode(protocol.encode(good)).inputs == [[1, 2], [3]]
    for bad in ([[1, "x"]], [1, 2], "ab"):
        with pytest.raises(protocol.MalformedMessage, match="inputs"):
            protocol.decode(protocol.encode(batch("r", bad)))  # type: ignore[arg-type]


# ---- the gateway: the embeddings lane, characters before tokens, first copy of each vector ----

def make_admission(**kw):
    from gateway.admission import Admission
    from gateway.config import Settings
    from gateway.metrics import GatewayMetrics

    return Admission(Settings(model_dir=Path("/nonexistent/m"), **kw), GatewayMetrics("m"))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_embeddings_have_their_own_lane_and_never_hold_chat_back():
    from gateway.errors import ApiError

    adm = make_admission(max_batch_total_tokens=1000, max_embedding_tokens=100)
    task = asyncio.create_task(adm.run())
    try:
        e1, e2, e3 = adm.submit(80, 400, pooling=True), adm.submit(60, 400, pooling=True), adm.submit(50, 400, pooling=True)
        chat = adm.submit(900, 400)  # all of the decode budget: not one token of it went to embeddings
        huge = adm.submit(101, 400, pooling=True)
        await settle()
        assert e1.decision.result() is None and chat.decision.result() is None
        assert not e2.decision.done()  # waits in the embeddings lane's FIFO
        overflow, too_big = e3.decision.result(), huge.decision.result()
        assert isinstance(overflow, ApiError) and overflow.status == 429  # the lane's queue holds 100 already
        assert isinstance(too_big, ApiError) and too_big.status == 400 and "max_embedding_tokens=100" in str(too_big)
        snapshot = adm.snapshot()
        assert snapshot["token_budget"]["in_use"] == 900
        assert snapshot["embeddings"] == {"tokens_total": 100, "tokens_in_use": 80, "running": 1, "waiting": 1}
        adm.done(e1)
        await settle()
        assert e2.decision.result() is None
        for ticket in (e2, e3, huge, chat):
            adm.done(ticket)
        await settle()
        assert adm.snapshot()["embeddings"]["tokens_in_use"] == 0 and adm.snapshot()["token_budget"]["in_use"] == 0
    finally:
        task.cancel()


def test_the_lane_is_a_flag_and_must_hold_a_token(tiny_model_dir):
    from gateway.__main__ import parse_args

    assert parse_args(["--model", str(tiny_model_dir)]).max_embedding_tokens == 65536
    settings = parse_args(["--model", str(tiny_model_dir), "--max-embedding-tokens", "0"])
    with pytest.raises(ValueError, match="--max-embedding-tokens"):
        settings.validate()


@pytest.fixture
def embeddings_app(tmp_path, default_model_dir, gw_tokenizer):
    """The gateway over an in-memory backend whose `responder` answers each batch (set per test)."""
    from gateway.app import create_app, in_memory_runtime
    from gateway.backend import InMemoryBackend
    from gateway.config import Settings

    backend = InMemoryBackend()
    settings = Settings(model_dir=default_model_dir, max_batch_total_tokens=100_000, event_timeout=10.0,
                        max_embedding_tokens=4096, max_input_tokens=1024)
    return create_app(settings, tokenizer=gw_tokenizer, runtime=in_memory_runtime(backend)), backend


async def call(app, path: str, body: dict):
    import httpx

    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.post(path, json=body, timeout=30)


async def test_a_request_too_long_in_characters_is_refused_before_tokenizing(embeddings_app, gw_tokenizer, monkeypatch):
    app, backend = embeddings_app
    calls = []
    monkeypatch.setattr(gw_tokenizer, "encode_texts", lambda *a: calls.append(a) or [])
    longest = gw_tokenizer.max_token_chars
    one = "x" * (1024 * longest + 1)  # more characters than max_input_tokens=1024 tokens can spell
    r = await call(app, "/v1/embeddings", {"input": ["fine", one]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]", r.text
    assert "characters" in r.json()["error"]["message"] and "max_input_tokens=1024" in r.json()["error"]["message"]
    many = ["y" * (longest * 300)] * 14  # each fits; together more than max_embedding_tokens=4096 tokens
    r = await call(app, "/embed", {"inputs": many})
    assert r.status_code == 422 and "max_embedding_tokens=4096" in r.json()["error"], r.text
    assert calls == [] and backend.prefills == []


async def test_the_first_copy_of_each_vector_is_kept_in_input_order(embeddings_app):
    """Vectors come as they are computed, in any order, and a batch a worker redid after another
    died sends some twice: the answer is each input's first vector, in input order."""
    app, backend = embeddings_app

    def vector(value: float) -> bytes:
        return protocol.pack_embedding(np.full(576, value))

    def respond(req: protocol.PrefillRequest) -> list[protocol.TokenEvent]:
        assert req.prompt_token_ids == [] and len(req.inputs) == 3 and req.pooling
        event = lambda i, v, end=None: protocol.TokenEvent(req.request_id, i, [], [], end, embedding=vector(v))  # noqa: E731
        return [event(2, 3.0), event(0, 1.0), event(2, 9.0), event(1, 2.0, FinishReason.STOP)]

    backend.responder = respond
    r = await call(app, "/embed", {"inputs": ["a", "b", "c"], "normalize": False})
    assert r.status_code == 200, r.text
    assert [row[0] for row in r.json()] == [1.0, 2.0, 3.0]
    assert len(backend.prefills) == 1  # one message for the whole request


async def test_a_big_answer_is_encoded_off_the_event_loop(embeddings_app):
    """1024 vectors of 576 floats as JSON take seconds of json.dumps (7 s for 2048 on a 2-core
    EPYC): built and encoded in a thread, one row at a time, while the loop keeps turning."""
    import httpx
    import numpy as np

    app, backend = embeddings_app
    backend.responder = lambda req: [
        protocol.TokenEvent(req.request_id, i, [], [], FinishReason.STOP if i == len(req.inputs) - 1 else None,
                            embedding=protocol.pack_embedding(np.random.default_rng(i).random(576)))
        for i in range(len(req.inputs))]
    wakes = [time.perf_counter()]  # when the loop last ran the probe

    async def probe() -> None:
        while True:
            await asyncio.sleep(0.01)
            wakes.append(time.perf_counter())

    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            assert (await client.post("/embed", json={"inputs": ["warm", "up"]})).status_code == 200
            body = {"inputs": [f"{i} x" for i in range(1024)]}
            wakes[0] = time.perf_counter()
            prober = asyncio.create_task(probe())
            r = await client.post("/embed", json=body, timeout=60)
            wakes.append(time.perf_counter())
            prober.cancel()
    longest_stall = max(b - a for a, b in zip(wakes, wakes[1:]))
    assert r.status_code == 200 and len(r.json()) == 1024 and len(r.json()[5]) == 576
    assert np.allclose(r.json()[5], np.random.default_rng(5).random(576) / np.linalg.norm(
        np.random.default_rng(5).random(576).astype(np.float32)), atol=1e-6)
    assert longest_stall < 0.5, longest_stall  # (inline: 1.1 s, the whole encoding)
