"""Prometheus metrics of the gateway (names `baton:*`, labelled with the served model name).

Each app gets its own registry, so several gateways can live in one process (tests) and /metrics
shows exactly this gateway. Names follow vLLM's (`vllm:num_requests_running`, ...) so dashboards
and aiperf's /metrics scraping work with little change.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0, 20.0)


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
            "baton:token_budget_total", "Token budget of the cluster (0: no decode worker alive).",
            m, registry=r).labels(model_name)
        self.prompt_tokens = Counter(
            "baton:prompt_tokens", "Prompt tokens of admitted requests.", m, registry=r).labels(model_name)
        self.generation_tokens = Counter(
            "baton:generation_tokens", "Generated tokens delivered.", m, registry=r).labels(model_name)
        self._success = Counter(
            "baton:request_success", "Requests that finished, by finish reason.",
            m + ["finished_reason"], registry=r)
        self._failure = Counter(
            "baton:request_failure", "Admitted requests that did not finish normally, by reason.",
            m + ["reason"], registry=r)
        self._rejections = Counter(
            "baton:request_rejections", "Requests answered with an error before admission, by reason.",
            m + ["reason"], registry=r)
        self.ttft = Histogram(
            "baton:time_to_first_token_seconds", "Time from arrival to the first token.", m,
            buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(
            "baton:inter_token_latency_seconds", "Time between consecutive tokens of a request.", m,
            buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(
            "baton:e2e_request_latency_seconds", "Time from arrival to the end of the request.", m,
            buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram(
            "baton:request_queue_time_seconds", "Time a request waited for admission.", m,
            buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        # Plain counts for /stats (prometheus counters are awkward to read back).
        self.rejections_by_reason: dict[str, int] = {}
        self.failures_by_reason: dict[str, int] = {}
        self.successes_by_reason: dict[str, int] = {}

    def reject(self, reason: str) -> None:
        self._rejections.labels(self.model_name, reason).inc()
        self.rejections_by_reason[reason] = self.rejections_by_reason.get(reason, 0) + 1

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()
        self.successes_by_reason[finished_reason] = self.successes_by_reason.get(finished_reason, 0) + 1

    def failure(self, reason: str) -> None:
        self._failure.labels(self.model_name, reason).inc()
        self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
