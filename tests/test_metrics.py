"""Prometheus metrics of a whole running system, checked against what the clients received.

One system (tiny model, one prefill and one decode worker, each exporting its own /metrics); a few
real greedy requests with `ignore_eos` (so each generates exactly max_tokens) through the OpenAI
API, streaming and not; then every counter that should have moved must have moved by exactly the
right amount, at the gateway and at each worker. The names are checked as prometheus_client
renders them (vLLM's names under `baton:` for the gateway and `baton:worker_` for the workers, so a
plain sum() over every process counts nothing twice; counters with `_total`, a `model_name` label).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from baton.cli.redis_server import free_port
from baton.common import heartbeats
from tests.cluster import Cluster
from tests.test_gateway_support import wait_until

BLOCK_SIZE = 16  # the workers' default

GATEWAY_NAMES = {
    "baton:num_requests_running": "gauge",
    "baton:num_requests_waiting": "gauge",
    "baton:token_budget_in_use": "gauge",
    "baton:token_budget_total": "gauge",
    "baton:prompt_tokens_total": "counter",
    "baton:generation_tokens_total": "counter",
    "baton:request_success_total": "counter",
    "baton:request_failure_total": "counter",
    "baton:request_rejections_total": "counter",
    "baton:time_to_first_token_seconds": "histogram",
    "baton:inter_token_latency_seconds": "histogram",
    "baton:e2e_request_latency_seconds": "histogram",
    "baton:request_queue_time_seconds": "histogram",
    "baton:http_requests_total": "counter",
    "baton:http_request_duration_seconds": "histogram",
    "baton:stream_length": "gauge",
    "baton:stream_pending": "gauge",
    "baton:stream_lag": "gauge",
    # the decode workers' engines, from their heartbeats (one series per live worker)
    "baton:kv_cache_usage_perc": "gauge",
    "baton:decode_num_requests_running": "gauge",
    "baton:decode_num_requests_waiting": "gauge",
    "baton:num_preemptions_total": "counter",
}
WORKER_NAMES = {
    "baton:worker_num_requests_running": "gauge",
    "baton:worker_num_requests_waiting": "gauge",
    "baton:worker_kv_cache_usage_perc": "gauge",
    "baton:worker_num_preemptions_total": "counter",
    "baton:worker_prompt_tokens_total": "counter",
    "baton:worker_generation_tokens_total": "counter",
    "baton:worker_prefix_cache_queries_total": "counter",
    "baton:worker_prefix_cache_hits_total": "counter",
    "baton:worker_iteration_tokens_total": "histogram",
    "baton:worker_request_prefill_time_seconds": "histogram",
    "baton:worker_request_decode_time_seconds": "histogram",
    "baton:worker_kv_handoff_latency_seconds": "histogram",
    "baton:worker_kv_handoff_bytes_total": "counter",
    "baton:worker_kv_blocks_fetched_total": "counter",
    "baton:worker_kv_blocks_computed_total": "counter",
    "baton:worker_requests_finished_total": "counter",
}

# Distinct first words, so no two prompts share a first KV block (no prefix-cache hits).
PROMPTS = [
    "Alpha: the quick brown fox jumps over the lazy dog while the band plays a slow waltz in the park.",
    "Bravo: seven sailors sang songs of distant harbours as the evening tide rolled against the pier.",
    "Delta: rivers carry silt to the sea, building wide flat plains where farmers grow rice and wheat.",
    "Foxtrot: mountains echo the calls of hikers who climb at dawn to watch the sun rise over the valley.",
]


class Scrape:
    """One /metrics page: samples by (name, labels), and the declared type of each family."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
                # The parser strips `_total` from counter family names: keep the rendered names.
                rendered = family.name + "_total" if family.type == "counter" else family.name
                self.types[rendered] = family.type

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels` (0 if none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def has(self, name: str, **labels: str) -> bool:
        want = set(labels.items())
        return any(n == name and want <= ls for (n, ls) in self.samples)


def scrape(url: str) -> Scrape:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    return Scrape(r.text)


@pytest.fixture(scope="module")
def system(tiny_model_dir):
    prefill_port, decode_port = free_port(), free_port()
    cluster = Cluster(tiny_model_dir, prefill=1, decode=1,
                      prefill_args=("--metrics-port", str(prefill_port)),
                      decode_args=("--metrics-port", str(decode_port)))
    try:
        urls = {"gateway": cluster.base_url + "/metrics",
                "prefill": f"http://127.0.0.1:{prefill_port}/metrics",
                "decode": f"http://127.0.0.1:{decode_port}/metrics"}
        deadline = time.time() + 30  # the workers' HTTP servers start with them; be sure they answer
        while True:
            try:
                for url in urls.values():
                    httpx.get(url, timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        yield cluster, urls
    finally:
        cluster.stop()


def scrape_all(urls: dict[str, str]) -> dict[str, Scrape]:
    return {name: scrape(url) for name, url in urls.items()}


def complete(base: str, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length", body
    return body["usage"]


def complete_stream(base: str, prompt: str, max_tokens: int) -> dict:
    usage, chunks, finish = None, 0, None
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event["choices"]:
                chunks += 1
                finish = event["choices"][0]["finish_reason"] or finish
            if event.get("usage"):
                usage = event["usage"]
    assert finish == "length" and usage is not None
    assert 1 <= chunks <= usage["completion_tokens"]  # one chunk per token event
    return usage


def test_metric_names_as_rendered(system):
    cluster, urls = system
    pages = scrape_all(urls)
    for name, kind in GATEWAY_NAMES.items():
        assert pages["gateway"].types.get(name) == kind, (name, pages["gateway"].types.get(name))
    model = cluster.model_dir.name
    assert pages["gateway"].has("baton:num_requests_running", model_name=model)
    # Series that exist from the first scrape, at 0, so rate() sees the first increment.
    for reason in ("stop", "length"):
        assert pages["gateway"].has("baton:request_success_total", model_name=model, finished_reason=reason)
    for reason in ("validation", "concurrency", "queue_full", "exceeds_budget"):
        assert pages["gateway"].has("baton:request_rejections_total", reason=reason)
    for stream in ("prefill", "decode"):  # sampled every 2 s by the gateway
        deadline = time.time() + 10
        while not scrape(urls["gateway"]).has("baton:stream_lag", stream=stream):
            assert time.time() < deadline, f"no baton:stream_lag for {stream}"
            time.sleep(0.2)
    # The decode worker's engine state is on the gateway's page too, labelled with its id.
    [decode_worker] = [ls for n, ls in pages["gateway"].samples if n == "baton:kv_cache_usage_perc"]
    assert dict(decode_worker)["model_name"] == model and dict(decode_worker)["worker"].startswith("decode-")
    for kind in ("prefill", "decode"):
        for name, family_type in WORKER_NAMES.items():
            assert pages[kind].types.get(name) == family_type, (kind, name, pages[kind].types.get(name))
        assert pages[kind].has("baton:worker_generation_tokens_total", model_name=model)
        # every worker series says which kind of worker it came from, whatever the scrape job is called
        unlabelled = {n for n, ls in pages[kind].samples if n.startswith("baton:worker_") and ("worker_kind", kind) not in ls}
        assert not unlabelled, (kind, unlabelled)
        for direction in ("fetched", "written"):
            assert pages[kind].has("baton:worker_kv_handoff_bytes_total", direction=direction)
        # Issue 13: no name means one thing at the gateway and another at a worker (sum() over
        # every scraped process would count requests and tokens twice).
        assert not set(pages["gateway"].types) & set(pages[kind].types), kind
    for kind, page in pages.items():  # no `_created` clutter next to every counter
        assert not [n for n, _ in page.samples if n.endswith("_created")], kind


def test_counters_move_by_exactly_what_was_served(system):
    cluster, urls = system
    base = cluster.base_url
    cluster.wait_idle()
    before = scrape_all(urls)

    # max_tokens=1 ends at the prefill worker (no handoff); its prompt is shorter than a block.
    plan = [(PROMPTS[0], 5, False), (PROMPTS[1], 8, False), ("Charlie says hi.", 1, False),
            (PROMPTS[2], 6, True), (PROMPTS[3], 9, True)]
    usages = []
    for prompt, max_tokens, stream in plan:
        usage = (complete_stream if stream else complete)(base, prompt, max_tokens)
        assert usage["completion_tokens"] == max_tokens, (usage, max_tokens)  # ignore_eos: exactly
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        usages.append(usage)
    cluster.wait_idle()
    after = scrape_all(urls)

    assert usages[2]["prompt_tokens"] < BLOCK_SIZE  # (so it writes no block either way)
    n = len(plan)
    received = sum(u["completion_tokens"] for u in usages)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert received == sum(max_tokens for _, max_tokens, _ in plan)
    handed_off = sum(1 for _, max_tokens, _ in plan if max_tokens > 1)  # max_tokens=1 ends at prefill
    full_blocks = sum(u["prompt_tokens"] // BLOCK_SIZE for u in usages)
    assert full_blocks > 0, "prompts must fill at least one KV block"

    def delta(kind: str, name: str, **labels: str) -> float:
        return after[kind].value(name, **labels) - before[kind].value(name, **labels)

    # Gateway: what the clients got, exactly.
    assert delta("gateway", "baton:generation_tokens_total") == received
    assert delta("gateway", "baton:prompt_tokens_total") == prompt_tokens
    assert delta("gateway", "baton:request_success_total", finished_reason="length") == n
    assert delta("gateway", "baton:request_success_total", finished_reason="stop") == 0
    assert delta("gateway", "baton:request_failure_total") == 0
    assert delta("gateway", "baton:request_rejections_total") == 0
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta("gateway", f"baton:{hist}_count") == n, hist
        assert delta("gateway", f"baton:{hist}_sum") > 0, hist
    # The first token of each request is its TTFT; every later one is an inter-token gap.
    assert delta("gateway", "baton:inter_token_latency_seconds_count") == received - n
    assert after["gateway"].value("baton:num_requests_running") == 0
    assert after["gateway"].value("baton:num_requests_waiting") == 0
    assert after["gateway"].value("baton:token_budget_in_use") == 0
    assert after["gateway"].value("baton:token_budget_total") > 0

    # Prefill worker: every prompt token, one first token per request, a prefill time per request.
    assert delta("prefill", "baton:worker_prompt_tokens_total") == prompt_tokens
    assert delta("prefill", "baton:worker_prefix_cache_queries_total") == prompt_tokens
    assert delta("prefill", "baton:worker_prefix_cache_hits_total") == 0  # distinct prompts
    assert delta("prefill", "baton:worker_generation_tokens_total") == n
    assert delta("prefill", "baton:worker_request_prefill_time_seconds_count") == n
    assert delta("prefill", "baton:worker_requests_finished_total", finished_reason="length") == n - handed_off
    # Full blocks of the handed-off prompts go to the store (the max_tokens=1 one never leaves).
    written = sum(u["prompt_tokens"] // BLOCK_SIZE for (_, mt, _), u in zip(plan, usages) if mt > 1)
    assert delta("prefill", "baton:worker_kv_blocks_computed_total") == full_blocks
    assert delta("prefill", "baton:worker_kv_blocks_written_total") == written
    assert delta("prefill", "baton:worker_kv_blocks_fetched_total") == 0
    assert delta("prefill", "baton:worker_kv_handoff_bytes_total", direction="written") > 0

    # Decode worker: every token but the first of each request, in one decode time per handoff.
    assert delta("decode", "baton:worker_generation_tokens_total") == received - n
    assert delta("decode", "baton:worker_prompt_tokens_total") == 0
    assert delta("decode", "baton:worker_request_decode_time_seconds_count") == handed_off
    assert delta("decode", "baton:worker_kv_handoff_latency_seconds_count") == handed_off
    assert delta("decode", "baton:worker_requests_finished_total", finished_reason="length") == handed_off
    assert delta("decode", "baton:worker_kv_blocks_fetched_total") == written  # the prompts' KV, from the store
    assert delta("decode", "baton:worker_kv_handoff_bytes_total", direction="fetched") > 0
    assert delta("decode", "baton:worker_num_preemptions_total") == 0
    assert delta("decode", "baton:worker_iteration_tokens_total_count") > 0
    assert after["decode"].value("baton:worker_kv_cache_usage_perc") == pytest.approx(0, abs=1e-9)
    assert after["decode"].value("baton:worker_num_requests_running") == 0


def test_prefix_cache_hits_are_counted(system):
    """The same prompt again: its full blocks are found, not recomputed."""
    cluster, urls = system
    cluster.wait_idle()
    before = scrape_all(urls)
    usage = complete(cluster.base_url, PROMPTS[0] + " Once more, from the top.", 3)
    cluster.wait_idle()
    after = scrape_all(urls)
    hits = after["prefill"].value("baton:worker_prefix_cache_hits_total") - before["prefill"].value(
        "baton:worker_prefix_cache_hits_total")
    queries = after["prefill"].value("baton:worker_prefix_cache_queries_total") - before["prefill"].value(
        "baton:worker_prefix_cache_queries_total")
    assert queries == usage["prompt_tokens"]
    assert 0 < hits < queries and hits % BLOCK_SIZE == 0, (hits, queries)
    computed = after["prefill"].value("baton:worker_kv_blocks_computed_total") - before["prefill"].value(
        "baton:worker_kv_blocks_computed_total")
    assert computed == usage["prompt_tokens"] // BLOCK_SIZE - hits // BLOCK_SIZE


def test_requests_are_counted_by_endpoint(system):
    """Each API counts under its own route template, with the status its client got: answered,
    refused by validation, and a path no route serves (one label value, whatever the path)."""
    cluster, urls = system
    base = cluster.base_url
    cluster.wait_idle()
    before = scrape(urls["gateway"])
    chat = {"messages": [{"role": "user", "content": "Bonjour, ça va ?"}], "max_tokens": 2}
    calls = [("POST", "/v1/chat/completions", chat, 200),
             ("POST", "/v1/chat/completions", {**chat, "max_tokens": -1}, 400),
             ("POST", "/v1/messages", {"model": cluster.model_dir.name, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "こんにちは"}]}, 200),
             ("POST", "/v1/responses", {"input": "Hello", "max_output_tokens": 2, "store": False}, 200),
             ("POST", "/v1/embeddings", {"input": ["one", "two"]}, 200),
             ("GET", "/v1/responses/resp_does_not_exist", None, 404),
             ("GET", "/v1/no/such/route", None, 404),
             ("GET", "/no-such-page", None, 404)]
    for method, path, body, status in calls:
        r = httpx.request(method, base + path, json=body, timeout=60)
        assert r.status_code == status, (path, r.status_code, r.text)
    after = scrape(urls["gateway"])

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    counted = "baton:http_requests_total"
    assert delta(counted, endpoint="/v1/chat/completions", method="POST", status="200") == 1
    assert delta(counted, endpoint="/v1/chat/completions", method="POST", status="400") == 1
    assert delta(counted, endpoint="/v1/messages", method="POST", status="200") == 1
    assert delta(counted, endpoint="/v1/responses", method="POST", status="200") == 1
    assert delta(counted, endpoint="/v1/embeddings", method="POST", status="200") == 1
    assert delta(counted, endpoint="/v1/responses/{response_id}", method="GET", status="404") == 1
    assert delta(counted, endpoint="unmatched", status="404") == 2
    assert not any("resp_does_not_exist" in dict(labels).get("endpoint", "") or
                   "no-such-page" in dict(labels).get("endpoint", "") for _, labels in after.samples)
    hist = "baton:http_request_duration_seconds"
    assert delta(hist + "_count", endpoint="/v1/chat/completions") == 2
    assert delta(hist + "_count", endpoint="/v1/messages") == 1
    assert delta(hist + "_sum", endpoint="/v1/messages") > 0


# ---- the Grafana dashboard (deploy/grafana/) queries exactly these metrics ----

REPO = Path(__file__).resolve().parent.parent
GRAFANA = REPO / "deploy" / "grafana"


def test_grafana_dashboard_queries_metrics_that_exist(system):
    """Every `baton:*` series a Grafana panel queries is one the system exports; a worker series is
    selected by the `worker_kind` label the worker itself sets, never by Prometheus' `job` (which
    only compose's prometheus.yml names: on Kubernetes the panels would be empty); the dashboard
    JSON is well formed."""
    cluster, urls = system
    pages = scrape_all(urls)

    def exported(name: str, kind: str | None) -> bool:
        if not name.startswith("baton:worker_"):
            return pages["gateway"].has(name)
        kinds = [kind] if kind else ["prefill", "decode"]
        return any(pages[k].has(name, worker_kind=k) for k in kinds)

    dashboard = json.loads((GRAFANA / "baton-dashboard.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for variable in dashboard["templating"]["list"]:
        assert "job" not in str(variable.get("query", "")), variable
    queried = selected_by_kind = 0
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        for tgt in panel.get("targets", []):
            assert tgt["datasource"]["uid"] == "${datasource}", panel["title"]
            expr = tgt["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert not re.search(r"\bjob\b", expr + tgt.get("legendFormat", "")), f"{panel['title']}: {expr}"
            for m in re.finditer(r"(baton:[a-z_]+)\{([^}]*)\}", expr):
                name, selector = m.groups()
                kind = re.search(r'worker_kind="([^"]+)"', selector)
                if kind:
                    assert name.startswith("baton:worker_"), f"{panel['title']}: {name} has no worker_kind"
                    selected_by_kind += 1
                assert exported(name, kind.group(1) if kind else None), f"{panel['title']}: {name} ({selector})"
                queried += 1
    assert queried >= 40 and selected_by_kind >= 15
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model"} <= names

    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert datasources[0]["type"] == "prometheus" and datasources[0]["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/baton.yml").read_text())["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_decode_workers_state_on_the_gateway_page_while_their_heartbeats_live(gw_server, gw_redis_url):
    """One scrape of the gateway shows each live decode worker's KV usage, batch, queue and
    preemptions (vLLM's names); a worker whose heartbeat expired leaves no series behind."""
    import redis

    r = redis.Redis.from_url(gw_redis_url)
    busy = {"num_requests_running": 3, "num_requests_loading_kv": 1, "num_requests_waiting": 2,
            "num_preemptions": 7, "kv_cache_usage": 0.5, "num_kv_blocks_total": 64, "num_kv_blocks_used": 32,
            "block_size": 16}
    # an engine that reports no kv_cache_usage: the blocks say it
    short_lived = {"num_requests_running": 0, "num_requests_waiting": 0, "num_preemptions": 0,
                   "num_kv_blocks_total": 64, "num_kv_blocks_used": 16, "block_size": 16}
    pipe = r.pipeline(transaction=False)
    heartbeats.queue_beat(pipe, "decode", "decode-busy", busy, 60)
    heartbeats.queue_beat(pipe, "decode", "decode-short", short_lived, 1.0)
    pipe.execute()
    try:
        url = gw_server.url + "/metrics"
        assert wait_until(lambda: scrape(url).has("baton:kv_cache_usage_perc", worker="decode-short"))
        page = scrape(url)
        assert page.value("baton:kv_cache_usage_perc", worker="decode-busy") == 0.5
        assert page.value("baton:kv_cache_usage_perc", worker="decode-short") == 0.25
        assert page.value("baton:decode_num_requests_running", worker="decode-busy") == 4  # loading KV counts
        assert page.value("baton:decode_num_requests_waiting", worker="decode-busy") == 2
        assert page.value("baton:num_preemptions_total", worker="decode-busy") == 7
        assert page.types["baton:num_preemptions_total"] == "counter"

        # decode-short stops beating: once its heartbeat expires its series are gone, the other's stay
        assert wait_until(lambda: not scrape(url).has("baton:kv_cache_usage_perc", worker="decode-short"),
                          timeout=10)
        page = scrape(url)
        for name in ("baton:decode_num_requests_running", "baton:decode_num_requests_waiting",
                     "baton:num_preemptions_total"):
            assert not page.has(name, worker="decode-short"), name
        assert page.value("baton:kv_cache_usage_perc", worker="decode-busy") == 0.5
    finally:
        pipe = r.pipeline(transaction=False)
        for worker_id in ("decode-busy", "decode-short"):
            heartbeats.queue_withdraw(pipe, "decode", worker_id)
        pipe.execute()
        r.close()
