"""Optional OpenTelemetry tracing: one trace per request, across the gateway and the workers.

Off unless both hold: an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, with the other standard `OTEL_*` variables) and the
OpenTelemetry SDK with its OTLP/HTTP exporter is installed (`pip install opentelemetry-sdk
opentelemetry-exporter-otlp-proto-http`: not a dependency of Baton). Off, every function here is a
no-op that returns at once.

Spans, all children of the gateway's `request` span (the request's life at the gateway, from
admission to its end):

    gateway  request     admission (waiting for token budget)
    prefill  prefill     the prompt on the prefill worker, admitted to handed off (or finished)
    decode   handoff     the first token to the decode worker's admission (KV through the store)
    decode   decode      admitted to finished

The request span's context travels in the messages as a W3C `traceparent` (PrefillRequest and
Handoff `trace_context`), which is what links the processes' spans into one trace.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_tracer: Any = None  # an opentelemetry Tracer once set up, else None (tracing off)
# The gateway's request span, as a traceparent, for the messages the request's task sends.
_request_parent: contextvars.ContextVar[str] = contextvars.ContextVar("baton_trace_parent", default="")


def setup_tracing(service: str, exporter: Any = None) -> bool:
    """Turn tracing on for this process if configured (see the module doc); True if it is on.

    `exporter`: a span exporter to use instead of OTLP (tests); spans are then exported at once.
    """
    global _tracer
    if exporter is None and not any(os.environ.get(name) for name in ENDPOINT_VARS):
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            processor: Any = BatchSpanProcessor(OTLPSpanExporter())
        else:
            processor = SimpleSpanProcessor(exporter)
    except ImportError as exc:
        log.warning("an OTLP endpoint is set but OpenTelemetry is not installed (%s): tracing is off; "
                    "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http", exc)
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(processor)
    atexit.register(provider.shutdown)  # the batch's last spans are sent before the process exits
    _tracer = provider.get_tracer("baton")
    log.info("tracing to OpenTelemetry as %s", service)
    return True


def disable() -> None:
    """Tracing off again (tests)."""
    global _tracer
    _tracer = None


def enabled() -> bool:
    return _tracer is not None


def start_span(name: str, parent: Any = None, attributes: dict[str, Any] | None = None,
               start_time_s: float | None = None) -> Any:
    """A started span (None when tracing is off). `parent`: a span, or a traceparent string from a
    message; `start_time_s`: wall-clock seconds when it began, if before now."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    if isinstance(parent, str):
        context = _extract(parent)
    elif parent is not None:
        context = trace.set_span_in_context(parent)
    else:
        context = None
    start = int(start_time_s * 1e9) if start_time_s is not None else None
    return _tracer.start_span(name, context=context, attributes=_clean(attributes), start_time=start)


def end_span(span: Any, error: str | None = None, end_time_s: float | None = None) -> None:
    if span is None:
        return
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=int(end_time_s * 1e9) if end_time_s is not None else None)


def traceparent(span: Any) -> str:
    """The W3C traceparent of `span`, for a message ("" when tracing is off)."""
    if span is None:
        return ""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def set_request_parent(value: str) -> None:
    """The current task's request span (as a traceparent): what request_parent() returns."""
    _request_parent.set(value)


def request_parent() -> str:
    """The traceparent for a message sent on behalf of the current request ("" when none)."""
    return _request_parent.get()


def _extract(value: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": value}) if value else None


def _clean(attributes: dict[str, Any] | None) -> dict[str, Any] | None:
    # OpenTelemetry refuses None values (and warns for each): drop them, and empty ids.
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None and v != ""}


class RequestSpans:
    """A worker's open spans by request id (a worker handles many requests in one loop)."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}

    def begin(self, request_id: str, name: str, parent: str, **attributes: Any) -> None:
        if _tracer is None:
            return
        self._open[request_id] = start_span(name, parent, {"baton.request_id": request_id, **attributes})

    def end(self, request_id: str, error: str | None = None) -> None:
        end_span(self._open.pop(request_id, None), error)

    def record(self, name: str, parent: str, start_time_s: float, **attributes: Any) -> None:
        """A span that already ended now (its start is in the past): e.g. a handoff's transit."""
        if _tracer is None:
            return
        end_span(start_span(name, parent, attributes, start_time_s=min(start_time_s, time.time())))
