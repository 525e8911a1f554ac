"""Prometheus metrics of the gateway (names `baton:*`, labelled with the served model name).

The workers' series are all `baton:worker_*` (baton/worker/metrics.py), so no name means one thing
here and another there: `sum(baton:num_requests_running)` over every scraped process counts each
request once. With several gateways, each one's `token_budget_total` is its share of the cluster's
budget (gateway/admission.py): their sum is the cluster's.

Each app gets its own registry, so several gateways can live in one process (tests) and /metrics
shows exactly this gateway. Names follow vLLM's (`vllm:num_requests_running`, ...) so dashboards
and aiperf's /metrics scraping work with little change. As rendered (prometheus_client appends
`_total` to counters):

    baton:num_requests_running, baton:num_requests_waiting            gauges
    baton:token_budget_in_use, baton:token_budget_total               gauges (tokens)
    baton:prompt_tokens_total, baton:generation_tokens_total          counters
    baton:request_success_total{finished_reason}                      counter (stop | length)
    baton:request_failure_total{reason}                               counter
    baton:request_rejections_total{reason}                            counter (answered before admission)
    baton:time_to_first_token_seconds, baton:inter_token_latency_seconds,
    baton:e2e_request_latency_seconds, baton:request_queue_time_seconds   histograms
    baton:stream_length{stream}, baton:stream_pending{stream}, baton:stream_lag{stream}
        backlog of `{baton}:prefill` / `{baton}:decode` (XLEN; delivered but not acked; not yet
        delivered to the consumer group), sampled every 2 s by the dashboard monitor
    baton:kv_cache_usage_perc{worker}                                 gauge (0-1, as vLLM's)
    baton:decode_num_requests_running{worker}, baton:decode_num_requests_waiting{worker}   gauges
    baton:num_preemptions_total{worker}                               counter
        each live decode worker's engine, from its heartbeat (`DecodeWorkerCollector`), so one
        scrape of the gateway shows the cluster; a worker's series go with its heartbeat

The decode workers' running / waiting are `decode_*`: `baton:num_requests_running` here already
means this gateway's admitted requests. With several gateways each reports every decode worker:
aggregate those series with max by (worker), not sum.

Besides the Prometheus objects the gateway keeps plain numbers for /stats and /dashboard: counts
by reason, the total of generated tokens, and the recent TTFT / ITL samples (a bounded window) from
which the dashboard computes exact percentiles.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0, 20.0)

# Label values created up front, so every series exists (at 0) from the first scrape: PromQL's
# rate()/increase() need the zero to see the first increment, and dashboards show "0", not "no data".
FINISHED_REASONS = ("stop", "length")
REJECTION_REASONS = ("validation", "payload_too_large", "concurrency", "exceeds_budget", "queue_full",
                     "queue_timeout", "client_disconnected", "redis_unavailable")
FAILURE_REASONS = ("client_disconnected", "timeout", "stream_gap", "worker_error", "worker_cancelled",
                   "redis_state_lost")


class CountedCounter:
    """A labelled Counter child that also keeps its total readable (`.total`)."""

    def __init__(self, child: Counter) -> None:
        self._child = child
        self.total = 0.0

    def inc(self, amount: float = 1) -> None:
        self._child.inc(amount)
        self.total += amount


class WindowedHistogram:
    """A labelled Histogram child that also keeps the most recent observations, with their time,
    for exact percentiles over a sliding window (at most `max_samples` of them)."""

    def __init__(self, child: Histogram, max_samples: int) -> None:
        self._child = child
        self.samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.count = 0

    def observe(self, value: float) -> None:
        self._child.observe(value)
        self.samples.append((time.monotonic(), value))
        self.count += 1

    def recent(self, since: float) -> list[float]:
        """Values observed at or after `since` (a time.monotonic() instant)."""
        samples = self.samples
        while samples and samples[0][0] < since:
            samples.popleft()
        return [v for _, v in samples]


def percentiles(values: Iterable[float], qs: Iterable[float]) -> list[float | None]:
    """Nearest-rank percentiles (q in [0, 1]); None for no data."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return [None for _ in qs]
    out: list[float | None] = []
    for q in qs:
        rank = max(1, min(n, int(-(-q * n // 1))))  # ceil(q * n), clamped to [1, n]
        out.append(ordered[rank - 1])
    return out


def _count(value: Any) -> int | None:
    # Heartbeats are another process's msgpack: a missing or foreign field is no series, not an error.
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def kv_cache_usage(beat: dict[str, Any]) -> float | None:
    """A decode heartbeat's KV usage (0-1): the engine's own figure, else used / total blocks."""
    usage = beat.get("kv_cache_usage")
    if isinstance(usage, (int, float)) and not isinstance(usage, bool) and 0 <= usage <= 1:
        return float(usage)
    used, total = _count(beat.get("num_kv_blocks_used")), _count(beat.get("num_kv_blocks_total"))
    return used / total if used is not None and total else None


class DecodeWorkerCollector:
    """The live decode workers' engine state as series labelled by `worker`, built at each scrape
    from the heartbeats last read (gateway.cluster): a worker whose heartbeat expired is simply not
    among them, so its series vanish and the label set stays bounded by the live workers."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.heartbeats: Sequence[dict[str, Any]] = ()  # set by GatewayMetrics.render

    def describe(self) -> Iterator[Metric]:
        # the names, so the registry refuses a Gauge or Counter that would clash with them
        return self._families(())

    def collect(self) -> Iterator[Metric]:
        return self._families(self.heartbeats)

    def _families(self, heartbeats: Sequence[dict[str, Any]]) -> Iterator[Metric]:
        labels = ["model_name", "worker"]
        usage = GaugeMetricFamily("baton:kv_cache_usage_perc",
                                  "Fraction of a decode worker's KV blocks in use (0-1), from its heartbeat.",
                                  labels=labels)
        running = GaugeMetricFamily("baton:decode_num_requests_running",
                                    "Requests in a decode worker's engine batch (or loading their KV), "
                                    "from its heartbeat.", labels=labels)
        waiting = GaugeMetricFamily("baton:decode_num_requests_waiting",
                                    "Requests queued inside a decode worker's engine, from its heartbeat.",
                                    labels=labels)
        # Cumulative in the worker's engine; a restarted worker has a new id, so each series only grows.
        preemptions = CounterMetricFamily("baton:num_preemptions",
                                          "Preemptions in a decode worker's engine, from its heartbeat.",
                                          labels=labels)
        for beat in heartbeats:
            series = [self.model_name, str(beat.get("worker_id", ""))]
            if (value := kv_cache_usage(beat)) is not None:
                usage.add_metric(series, value)
            in_batch, loading = _count(beat.get("num_requests_running")), _count(beat.get("num_requests_loading_kv"))
            if in_batch is not None:
                running.add_metric(series, in_batch + (loading or 0))  # as the worker's own gauge counts
            if (queued := _count(beat.get("num_requests_waiting"))) is not None:
                waiting.add_metric(series, queued)
            if (count := _count(beat.get("num_preemptions"))) is not None:
                preemptions.add_metric(series, count)
        yield from (usage, running, waiting, preemptions)


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        m = ["model_name"]
        self.model_name = model_name
        self.num_requests_running = Gauge(
            "baton:num_requests_running", "Requests admitted and not yet finished.", m, registry=r
        ).labels(model_name)
        self.num_requests_waiting = Gauge(
            "baton:num_requests_waiting", "Requests waiting in the admission queue.", m, registry=r
        ).labels(model_name)
        self.token_budget_in_use = Gauge(
            "baton:token_budget_in_use", "Tokens reserved by admitted requests (input + max new).",
            m, registry=r).labels(model_name)
        self.token_budget_total = Gauge(
            "baton:token_budget_total", "This gateway's share of the cluster's token budget (0: no decode worker alive).",
            m, registry=r).labels(model_name)
        self.prompt_tokens = CountedCounter(Counter(
            "baton:prompt_tokens", "Prompt tokens of admitted requests.", m, registry=r).labels(model_name))
        self.generation_tokens = CountedCounter(Counter(
            "baton:generation_tokens", "Generated tokens delivered.", m, registry=r).labels(model_name))
        # (their prompt tokens count in baton:prompt_tokens, their ends in baton:request_success)
        self.embedding_inputs = CountedCounter(Counter(
            "baton:embedding_inputs", "Embedding inputs answered (/v1/embeddings, /embed).", m,
            registry=r).labels(model_name))
        self._success = Counter(
            "baton:request_success", "Requests that finished, by finish reason.",
            m + ["finished_reason"], registry=r)
        self._failure = Counter(
            "baton:request_failure", "Admitted requests that did not finish normally, by reason.",
            m + ["reason"], registry=r)
        self._rejections = Counter(
            "baton:request_rejections", "Requests answered with an error before admission, by reason.",
            m + ["reason"], registry=r)
        self.ttft = WindowedHistogram(Histogram(
            "baton:time_to_first_token_seconds", "Time from arrival to the first token.", m,
            buckets=_LATENCY_BUCKETS, registry=r).labels(model_name), max_samples=20_000)
        self.itl = WindowedHistogram(Histogram(
            "baton:inter_token_latency_seconds", "Time between consecutive tokens of a request.", m,
            buckets=_ITL_BUCKETS, registry=r).labels(model_name), max_samples=50_000)
        self.e2e = WindowedHistogram(Histogram(
            "baton:e2e_request_latency_seconds", "Time from arrival to the end of the request.", m,
            buckets=_LATENCY_BUCKETS, registry=r).labels(model_name), max_samples=20_000)
        self.queue_time = Histogram(
            "baton:request_queue_time_seconds", "Time a request waited for admission.", m,
            buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self._http_requests = Counter(
            "baton:http_requests", "HTTP requests answered, by route template, method and status.",
            m + ["endpoint", "method", "status"], registry=r)
        self._http_duration = Histogram(
            "baton:http_request_duration_seconds", "Time from a request's arrival to its last byte, by route.",
            m + ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        stream_labels = m + ["stream"]
        self._stream_length = Gauge(
            "baton:stream_length", "Entries in the work stream (XLEN of {baton}:<stream>).",
            stream_labels, registry=r)
        self._stream_pending = Gauge(
            "baton:stream_pending", "Entries delivered to the stream's consumer group and not yet acked.",
            stream_labels, registry=r)
        self._stream_lag = Gauge(
            "baton:stream_lag", "Entries not yet delivered to the stream's consumer group (its lag).",
            stream_labels, registry=r)
        self.decode_workers = DecodeWorkerCollector(model_name)
        r.register(self.decode_workers)
        for reason in FINISHED_REASONS:
            self._success.labels(model_name, reason)
        for reason in REJECTION_REASONS:
            self._rejections.labels(model_name, reason)
        for reason in FAILURE_REASONS:
            self._failure.labels(model_name, reason)
        # Plain counts for /stats (prometheus counters are awkward to read back).
        self.rejections_by_reason: dict[str, int] = {}
        self.failures_by_reason: dict[str, int] = {}
        self.successes_by_reason: dict[str, int] = {}
        # The last stream sample: {"prefill": {"length", "pending", "lag"}, ...} (None: unknown).
        self.streams: dict[str, dict[str, int | None]] = {}

    def reject(self, reason: str) -> None:
        self._rejections.labels(self.model_name, reason).inc()
        self.rejections_by_reason[reason] = self.rejections_by_reason.get(reason, 0) + 1

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()
        self.successes_by_reason[finished_reason] = self.successes_by_reason.get(finished_reason, 0) + 1

    def failure(self, reason: str) -> None:
        self._failure.labels(self.model_name, reason).inc()
        self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1

    def http_request(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        self._http_requests.labels(self.model_name, endpoint, method, str(status)).inc()
        self._http_duration.labels(self.model_name, endpoint).observe(seconds)

    def set_stream(self, stream: str, length: int | None, pending: int | None, lag: int | None) -> None:
        self.streams[stream] = {"length": length, "pending": pending, "lag": lag}
        for gauge, value in ((self._stream_length, length), (self._stream_pending, pending),
                             (self._stream_lag, lag)):
            if value is not None:
                gauge.labels(self.model_name, stream).set(value)

    def render(self, decode_heartbeats: Sequence[dict[str, Any]] = ()) -> bytes:
        """The /metrics page; `decode_heartbeats`: the live decode workers' (Cluster.workers["decode"])."""
        self.decode_workers.heartbeats = decode_heartbeats
        return generate_latest(self.registry)
