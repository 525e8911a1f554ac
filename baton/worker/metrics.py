"""Prometheus metrics of a worker process (vLLM's names under `baton:worker_`, with model_name and worker_kind labels).

Every worker series is named `baton:worker_*`, every gateway series `baton:*` without it: the same
quantity seen by both (requests running, prompt and generated tokens) must not share a name, or a
plain `sum()` over all scraped processes counts it twice. As rendered by prometheus_client
(counters get `_total`; every series carries `worker_kind="prefill"|"decode"`, so a dashboard or
an alert selects a kind whatever the scrape config names its jobs: compose's, Kubernetes' pods):

    baton:worker_num_requests_running, baton:worker_num_requests_waiting,
    baton:worker_kv_cache_usage_perc                                                     gauges
    baton:worker_num_preemptions_total, baton:worker_prompt_tokens_total,
    baton:worker_generation_tokens_total
    baton:worker_prefix_cache_queries_total, baton:worker_prefix_cache_hits_total        (tokens)
    baton:worker_kv_blocks_fetched_total, baton:worker_kv_blocks_missing_total,
    baton:worker_kv_blocks_computed_total, baton:worker_kv_blocks_written_total,
    baton:worker_kv_blocks_rejected_total
    baton:worker_kv_handoff_bytes_total{direction="fetched"|"written"}, baton:worker_dead_letters_total
    baton:worker_requests_finished_total{finished_reason}
    baton:worker_iteration_tokens_total, baton:worker_engine_step_seconds,
    baton:worker_kv_handoff_latency_seconds, baton:worker_request_prefill_time_seconds,
    baton:worker_request_decode_time_seconds                                             histograms
    baton:worker_stream_backlog                                                          gauge
    baton:worker_spec_decode_num_drafts_total, baton:worker_spec_decode_num_draft_tokens_total,
    baton:worker_spec_decode_num_accepted_tokens_total,
    baton:worker_spec_decode_num_accepted_tokens_per_pos_total{position}     (decode, speculating)

A prefill worker counts the prompt tokens and the first token of each request; the decode worker
every later token (so prefill + decode worker generation_tokens = the tokens the gateway delivered,
`baton:generation_tokens_total`).
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from baton.common.finish_reason import WIRE_REASONS, FinishReason

# worker_kind: the process's own kind, not Prometheus' `job`, which only a scrape config sets.
LABELS = ["model_name", "worker_kind"]
_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    def __init__(self, model_name: str, kind: str, registry: CollectorRegistry = REGISTRY) -> None:
        """`registry`: a private one lets several workers' metrics live in one process (tests)."""
        self.model_name = model_name
        self.kind = kind
        r = registry
        lbl = {"model_name": model_name, "worker_kind": kind}
        self._labels = lbl
        self.num_requests_running = Gauge("baton:worker_num_requests_running", "Requests in the engine's batch", LABELS, registry=r).labels(**lbl)
        self.num_requests_waiting = Gauge("baton:worker_num_requests_waiting", "Requests waiting in the engine", LABELS, registry=r).labels(**lbl)
        self.kv_cache_usage_perc = Gauge("baton:worker_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", LABELS, registry=r).labels(**lbl)
        self.num_preemptions = Counter("baton:worker_num_preemptions", "Preemptions", LABELS, registry=r).labels(**lbl)
        self.prompt_tokens = Counter("baton:worker_prompt_tokens", "Prompt tokens processed", LABELS, registry=r).labels(**lbl)
        self.generation_tokens = Counter("baton:worker_generation_tokens", "Tokens generated", LABELS, registry=r).labels(**lbl)
        self.prefix_cache_queries = Counter("baton:worker_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", LABELS, registry=r).labels(**lbl)
        self.prefix_cache_hits = Counter("baton:worker_prefix_cache_hits", "Prompt tokens found in the prefix cache", LABELS, registry=r).labels(**lbl)
        self.iteration_tokens = Histogram("baton:worker_iteration_tokens_total", "Tokens per engine step", LABELS,
                                          buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048), registry=r).labels(**lbl)
        self.step_seconds = Histogram("baton:worker_engine_step_seconds", "Wall time of one engine step", LABELS,
                                      buckets=_TIME_BUCKETS, registry=r).labels(**lbl)
        self.step_threads = Gauge("baton:worker_step_threads", "Torch threads the last engine step ran on (a decode worker's "
                                  "own plus any an idle prefill worker on its machine lent it)", LABELS, registry=r).labels(**lbl)
        self.borrowed_steps = Counter("baton:worker_borrowed_steps", "Engine steps this decode worker ran with threads an idle "
                                      "prefill worker on its machine lent it", LABELS, registry=r).labels(**lbl)
        self.core_reclaim_seconds = Gauge("baton:worker_core_reclaim_wait_seconds", "Seconds this prefill worker has waited "
                                          "in all for the cores it lent to come back", LABELS, registry=r).labels(**lbl)
        self.blocks_fetched = Counter("baton:worker_kv_blocks_fetched", "Full KV blocks loaded from the store", LABELS, registry=r).labels(**lbl)
        self.blocks_missing = Counter("baton:worker_kv_blocks_missing", "KV blocks a load expected that the store no longer had (computed instead)", LABELS, registry=r).labels(**lbl)
        self.blocks_rejected = Counter("baton:worker_kv_blocks_rejected", "KV blocks from the store that were unreadable or of the wrong dtype, shape or size (a miss: computed instead)", LABELS, registry=r).labels(**lbl)
        self.blocks_computed = Counter("baton:worker_kv_blocks_computed", "Full KV blocks computed here", LABELS, registry=r).labels(**lbl)
        self.blocks_written = Counter("baton:worker_kv_blocks_written", "KV blocks written to the store", LABELS, registry=r).labels(**lbl)
        self.handoff_bytes = Counter("baton:worker_kv_handoff_bytes", "Bytes of KV moved through the store", LABELS + ["direction"], registry=r)
        self.handoff_latency = Histogram("baton:worker_kv_handoff_latency_seconds",
                                         "First token to decode-side admission (decode) / publish time (prefill)",
                                         LABELS, buckets=_TIME_BUCKETS, registry=r).labels(**lbl)
        self.request_prefill_time = Histogram("baton:worker_request_prefill_time_seconds", "Prefill time of a request",
                                              LABELS, buckets=_TIME_BUCKETS, registry=r).labels(**lbl)
        self.request_decode_time = Histogram("baton:worker_request_decode_time_seconds", "Decode time of a request",
                                             LABELS, buckets=_TIME_BUCKETS, registry=r).labels(**lbl)
        self.dead_letters = Counter("baton:worker_dead_letters", "Malformed messages parked in the dead-letter stream", LABELS, registry=r).labels(**lbl)
        self.stream_backlog = Gauge("baton:worker_stream_backlog", "Messages not yet delivered to this worker's group", LABELS, registry=r).labels(**lbl)
        self.requests_finished = Counter("baton:worker_requests_finished", "Requests this worker ended", LABELS + ["finished_reason"], registry=r)
        # speculative decoding (vLLM's spec_decode series): verify rows, proposals, accepted ones
        self.spec_drafts = Counter("baton:worker_spec_decode_num_drafts", "Speculating rows verified", LABELS, registry=r).labels(**lbl)
        self.spec_draft_tokens = Counter("baton:worker_spec_decode_num_draft_tokens", "Proposed tokens verified", LABELS, registry=r).labels(**lbl)
        self.spec_accepted_tokens = Counter("baton:worker_spec_decode_num_accepted_tokens", "Proposed tokens accepted", LABELS, registry=r).labels(**lbl)
        self.spec_accepted_per_pos = Counter("baton:worker_spec_decode_num_accepted_tokens_per_pos",
                                             "Verify rows whose proposal at this position was accepted",
                                             LABELS + ["position"], registry=r)
        self._spec_seen: tuple[int, int, int, tuple[int, ...]] = (0, 0, 0, ())

        # Every label value up front, so the series exist (at 0) from the first scrape.
        for direction in ("fetched", "written"):
            self.handoff_bytes.labels(**lbl, direction=direction)
        for reason in sorted(WIRE_REASONS):
            self.requests_finished.labels(**lbl, finished_reason=str(reason))

    def spec_decode(self, drafts: int, draft_tokens: int, accepted: int, per_pos: tuple[int, ...]) -> None:
        """Advance the spec_decode counters to the engine's cumulative counts (EngineStats.spec_*)."""
        seen_drafts, seen_tokens, seen_accepted, seen_pos = self._spec_seen
        self.spec_drafts.inc(drafts - seen_drafts)
        self.spec_draft_tokens.inc(draft_tokens - seen_tokens)
        self.spec_accepted_tokens.inc(accepted - seen_accepted)
        for position, count in enumerate(per_pos):
            before = seen_pos[position] if position < len(seen_pos) else 0
            series = self.spec_accepted_per_pos.labels(**self._labels, position=str(position))
            series.inc(count - before)
        self._spec_seen = (drafts, draft_tokens, accepted, tuple(per_pos))

    def bytes(self, direction: str, n: int) -> None:
        self.handoff_bytes.labels(**self._labels, direction=direction).inc(n)

    def finished(self, reason: FinishReason) -> None:
        self.requests_finished.labels(**self._labels, finished_reason=str(reason)).inc()

