"""Optional OpenTelemetry tracing (issue 13, 6): off unless configured; on, one request is one trace
whose spans (gateway request and admission, prefill, handoff, decode) share the gateway's trace."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from baton.common import protocol, tracing
from baton.worker.core import Opening
from tests.test_worker_core import PROMPT, decode_core, drive, fetch_loads, fields_of, new_store, prefill_core, request

sdk = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")


@pytest.fixture
def spans():
    exporter = sdk.InMemorySpanExporter()
    assert tracing.setup_tracing("baton-test", exporter=exporter)
    yield exporter
    tracing.disable()


def test_off_without_an_endpoint_and_off_with_a_warning_without_the_packages(monkeypatch, caplog):
    for name in tracing.ENDPOINT_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not tracing.setup_tracing("baton-test") and not tracing.enabled()
    assert tracing.start_span("x") is None and tracing.traceparent(None) == ""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)  # not installed
    with caplog.at_level(logging.WARNING, logger="baton.common.tracing"):
        assert not tracing.setup_tracing("baton-test")
    assert "OpenTelemetry is not installed" in caplog.text and not tracing.enabled()


async def test_admission_gives_the_request_span_and_its_wait(spans):
    from tests.test_gateway_admission import make_admission, settle

    adm, _ = make_admission(max_batch_total_tokens=100)
    task = asyncio.create_task(adm.run())
    try:
        ticket = adm.submit(60, 422)
        parent = tracing.request_parent()
        rejected = adm.submit(101, 422)  # larger than the budget: refused
        await settle()
        adm.done(ticket)
        adm.done(rejected)
        await settle()
    finally:
        task.cancel()
    by_name = {}
    for span in spans.get_finished_spans():
        by_name.setdefault(span.name, []).append(span)
    first_request, second_request = by_name["request"]
    assert {s.parent.span_id for s in by_name["admission"]} == {first_request.context.span_id,
                                                                second_request.context.span_id}
    assert f"{first_request.context.trace_id:032x}" in parent  # what the messages carry
    assert first_request.status.is_ok and not second_request.status.is_ok
    assert second_request.status.description == "exceeds_budget"


def test_one_request_is_one_trace_across_prefill_and_decode(spans, tiny_model_dir, one_torch_thread):
    root = tracing.start_span("request")
    parent = tracing.traceparent(root)
    store = new_store()
    req = request(PROMPT)
    req.trace_context = parent
    decoded = protocol.decode(protocol.encode(req), protocol.PrefillRequest)  # the field travels
    assert decoded.trace_context == parent

    core = prefill_core(tiny_model_dir)
    opened = core.open(fields_of(decoded), 1, set())
    core.admit(b"1-0", opened.message, [])
    effects, _ = drive(core, store)
    [handoff] = effects.handoffs
    assert handoff.trace_context == parent

    decode = decode_core(tiny_model_dir)
    opened = decode.open(fields_of(handoff), 1, set())
    assert opened.outcome is Opening.ADMIT
    decode.admit(b"9-0", opened.message)
    decode.engine.step()
    drive(decode, store, loaded=fetch_loads(decode, store))
    tracing.end_span(root)

    finished = {s.name: s for s in spans.get_finished_spans()}
    assert set(finished) == {"request", "prefill", "handoff", "decode"}
    trace_id = root.get_span_context().trace_id
    assert all(s.context.trace_id == trace_id for s in finished.values())
    for name in ("prefill", "handoff", "decode"):
        assert finished[name].parent.span_id == root.get_span_context().span_id, name
        assert finished[name].attributes["baton.request_id"] == "r1"
    assert finished["prefill"].end_time <= finished["decode"].end_time
    assert finished["decode"].status.is_ok
