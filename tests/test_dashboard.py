"""The live dashboard: /dashboard/data against a running system, the page rendered by headless
Chromium (the DOM after its JavaScript ran, and a screenshot), the API-key rule, and the monitor's
stream-backlog sampling and worker-health bookkeeping.

The Chromium tests need Debian's `chromium` (`apt-get install -y --no-install-recommends chromium`);
without /usr/bin/chromium they are skipped, saying so.

Run as a script to refresh the screenshot in the docs (real default model, real load, ~2 minutes):

    .venv/bin/python tests/test_dashboard.py --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import asyncio
import html
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # when run as a script

from tests.cluster import Cluster  # noqa: E402

CHROMIUM = "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed (no /usr/bin/chromium): "
           "apt-get install -y --no-install-recommends chromium")


# ---- helpers ----

def chromium(url: str, *args: str, budget_ms: int = 5000, timeout: float = 90) -> subprocess.CompletedProcess:
    """Headless Chromium on `url`; --virtual-time-budget lets the page's timers and fetches run first."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="baton-chromium-") as profile:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--no-first-run", "--no-default-browser-check", "--hide-scrollbars", "--mute-audio",
               f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *args, url]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"chromium failed ({result.returncode}): {result.stderr[-2000:]}"
    return result


def dump_dom(url: str) -> str:
    return chromium(url, "--dump-dom").stdout


def screenshot(url: str, out: Path, width: int = 1280, height: int = 900) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    chromium(url, f"--screenshot={out}", f"--window-size={width},{height}")
    assert out.exists() and out.stat().st_size > 10_000, "no (or an empty) screenshot"
    return out


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def element_text(dom: str, element_id: str) -> str:
    """The text inside the element with this id (tags stripped)."""
    m = re.search(rf'<(\w+)[^>]*\bid="{re.escape(element_id)}"[^>]*>(.*?)</\1>', dom, re.S)
    assert m, f"no element #{element_id} in the DOM"
    return html.unescape(re.sub(r"<[^>]+>", "", m.group(2))).strip()


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        raise AssertionError(f"not a number: {text!r}") from None


class Load:
    """Clients sending completions in a loop until stopped (429s are retried after a pause)."""

    def __init__(self, base_url: str, clients: int = 3, max_tokens: int = 24, api_key: str | None = None,
                 prompts: list[str] | None = None, backoff_s: float = 0.2) -> None:
        self.base_url = base_url
        self.backoff_s = backoff_s
        self.max_tokens = max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.prompts = prompts or ["Tell me about the history of the violin.", "Why is the sky blue?",
                                   "Write a short poem about a relay race.", "List five rivers in Europe."]
        self.stop_event = threading.Event()
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self.stop_event.is_set():
                n += 1
                prompt = f"{self.prompts[(i + n) % len(self.prompts)]} (client {i}, request {n})"
                try:
                    r = client.post(self.base_url + "/v1/completions", headers=self.headers, json={
                        "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True})
                    self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
                    if r.status_code == 429:
                        time.sleep(self.backoff_s)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=130)


def wait_for_data(base_url: str, predicate, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    data: dict = {}
    while time.time() < deadline:
        data = httpx.get(base_url + "/dashboard/data", timeout=5).json()
        if predicate(data):
            return data
        time.sleep(0.3)
    raise AssertionError(f"dashboard data never got there: {data.get('now')}")


# ---- a running system ----

@pytest.fixture(scope="module")
def system(tiny_model_dir):
    cluster = Cluster(tiny_model_dir, prefill=1, decode=1)
    yield cluster
    cluster.stop()


def test_page_is_self_contained(system):
    r = httpx.get(system.base_url + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    # Nothing from outside (the machines have no internet): no external scripts, styles, fonts, images.
    assert not re.search(r'<(script|link|img|iframe)[^>]+(src|href)=', page, re.I), "external asset in the page"
    assert "http://" not in page and "https://" not in page and "@import" not in page
    for element_id in ("tokens-per-second", "requests-running", "requests-waiting", "ttft-p50", "ttft-p99",
                       "itl-p50", "itl-p99", "budget-in-use", "preemptions", "rejections", "workers", "kv-bars"):
        assert f'id="{element_id}"' in page, element_id
    spec = httpx.get(system.base_url + "/openapi.json").json()
    assert "/dashboard" in spec["paths"] and "/dashboard/data" in spec["paths"]


def test_data_follows_the_load(system):
    with Load(system.base_url) as load:
        data = wait_for_data(system.base_url, lambda d: d["now"]["tokens_per_s"] > 0
                             and d["now"]["ttft_p50"] is not None and d["now"]["itl_p99"] is not None)
    assert not load.errors and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
    now, series = data["now"], data["series"]
    assert now["ttft_p50"] <= now["ttft_p99"] and now["itl_p50"] <= now["itl_p99"]
    assert now["generated_tokens"] > 0 and now["budget_total"] > 0
    lengths = {len(v) for v in series.values()}
    assert len(lengths) == 1 and lengths.pop() >= 1, "series must be parallel arrays"
    assert any(v and v > 0 for v in series["tokens_per_s"])
    assert series["t"] == sorted(series["t"])
    workers = {(w["kind"], w["worker_id"]): w for w in data["workers"]}
    for key in (("prefill", "prefill-0"), ("decode", "decode-0")):
        assert workers[key]["status"] == "ok" and workers[key]["age_s"] < 3, workers[key]
    assert workers[("decode", "decode-0")]["kv_total"] > 0
    assert any(w["kind"] == "gateway" and w.get("self") for w in data["workers"])
    assert set(now["streams"]) == {"prefill", "decode"}
    # The data is JSON the page can use as is: no NaN, nothing but plain values.
    assert "NaN" not in httpx.get(system.base_url + "/dashboard/data").text


@needs_chromium
def test_page_renders_live_numbers_in_chromium(system, tmp_path):
    url = system.base_url + "/dashboard"
    with Load(system.base_url):
        wait_for_data(system.base_url, lambda d: d["now"]["tokens_per_s"] > 0 and len(d["series"]["t"]) >= 3)
        dom = dump_dom(url)
        shot = screenshot(url, tmp_path / "dashboard.png")
    assert number(element_text(dom, "tokens-per-second")) > 0
    assert number(element_text(dom, "requests-running")) >= 0
    assert number(element_text(dom, "requests-waiting")) >= 0
    assert number(element_text(dom, "budget-in-use")) >= 0
    assert number(element_text(dom, "ttft-p50")) > 0
    assert element_text(dom, "ttft-p50-unit") in ("ms", "s")
    assert element_text(dom, "ttft-p99") != "–" and element_text(dom, "itl-p99") != "–"
    assert element_text(dom, "preemptions") == "0" and number(element_text(dom, "rejections")) == 0
    assert element_text(dom, "model") == system.model_dir.name
    assert element_text(dom, "live-pill") == "live" and element_text(dom, "redis-pill") == "Redis ok"
    # One row per worker, each healthy; one KV bar per decode worker; charts drawn.
    for kind, worker_id in (("prefill", "prefill-0"), ("decode", "decode-0")):
        assert re.search(rf'<tr class="worker-row" data-kind="{kind}" data-worker-id="{worker_id}" '
                         rf'data-status="ok">', dom), f"no healthy row for {worker_id}"
    assert 'class="kv-row" data-worker-id="decode-0"' in dom
    assert re.search(r'<svg id="chart-tps"[^>]*>.*<path d="M', dom, re.S), "throughput chart not drawn"
    assert png_size(shot) == (1280, 900)


@needs_chromium
def test_page_without_data_says_so(tmp_path):
    """A gateway that cannot be reached: the page must say 'disconnected', not show stale numbers."""
    from baton.cli.redis_server import free_port

    port = free_port()
    page = tmp_path / "dashboard.html"
    page.write_bytes((Path(__file__).resolve().parent.parent / "gateway/static/dashboard.html").read_bytes())
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 10
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/dashboard.html", timeout=1)
                break
            except httpx.HTTPError:
                assert time.time() < deadline
                time.sleep(0.1)
        dom = dump_dom(f"http://127.0.0.1:{port}/dashboard.html")
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert element_text(dom, "live-pill") in ("HTTP 404", "disconnected")
    assert element_text(dom, "tokens-per-second") == "–"


# ---- the API key: headers as everywhere, and a login form for a browser ----


def test_api_key_protects_page_and_data(default_model_dir, redis_url):
    from gateway.tokenizer import PromptTokenizer
    from tests.test_gateway_support import private_db, start_gateway

    server = start_gateway(default_model_dir, private_db(redis_url, 14), PromptTokenizer(default_model_dir),
                           api_key="s3cret")
    try:
        for path in ("/stats", "/dashboard", "/dashboard/data"):
            r = httpx.get(server.url + path)
            assert r.status_code == 401, path
            assert r.json()["error_type"] == "authentication" and r.headers["www-authenticate"] == "Bearer"
            r = httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"] == "invalid API key", path
            r = httpx.get(server.url + path, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200, path
        spec = httpx.get(server.url + "/openapi.json", headers={"x-api-key": "s3cret"}).json()
        assert {"bearer": []} in spec["paths"]["/dashboard/data"]["get"]["security"]
        _browser_login(server.url, "s3cret")
    finally:
        server.stop()


def _browser_login(base_url: str, key: str) -> None:
    """What a browser does with a keyed gateway: the page answers a form, the form posts the key,
    the session cookie then opens the page and its data, and nothing else."""
    browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    r = httpx.get(base_url + "/dashboard", headers=browser)
    assert r.status_code == 401 and r.headers["content-type"].startswith("text/html")
    assert re.search(r'<form id="login" method="post" action="dashboard/login">', r.text)
    assert 'name="key" type="password"' in r.text and "set-cookie" not in r.headers
    for wrong in ({"key": "nope"}, {}, {"key": ""}):
        r = httpx.post(base_url + "/dashboard/login", data=wrong)
        assert r.status_code == 401 and "set-cookie" not in r.headers, wrong
        assert 'action="login"' in r.text and 'id="login-error"' in r.text
    with httpx.Client(base_url=base_url, follow_redirects=False) as client:
        r = client.post("/dashboard/login", data={"key": key})
        assert r.status_code == 303 and r.headers["location"] == "../dashboard"
        cookie = r.headers["set-cookie"]
        assert re.search(r"HttpOnly", cookie, re.I) and re.search(r"SameSite=strict", cookie, re.I)
        assert "Path=/;" in cookie + ";" and key not in cookie  # the cookie is not the key
        back = r.url.join(r.headers["location"])  # relative: works behind a path prefix
        assert back.path == "/dashboard"
        r = client.get(back, headers=browser)
        assert r.status_code == 200 and 'fetch("dashboard/data"' in r.text
        r = client.get("/dashboard/data")
        assert r.status_code == 200 and r.json()["model"]
        # Only the dashboard's own GETs: the cookie opens nothing else (CSRF), not even /stats.
        assert client.get("/stats").status_code == 401
        assert client.get("/openapi.json").status_code == 401
        assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
                           ).status_code == 401
        assert client.delete("/v1/responses/resp_1").status_code == 401
    tampered = cookie.split(";", 1)[0][:-1] + ("0" if not cookie.split(";", 1)[0].endswith("0") else "1")
    r = httpx.get(base_url + "/dashboard/data", headers={"Cookie": tampered})
    assert r.status_code == 401


def test_session_cookies_expire_and_belong_to_their_key():
    from gateway.dashboard_login import session_token, session_valid

    now = 1_000_000
    assert session_valid("k", session_token("k", now + 60), now=now)
    assert not session_valid("k", session_token("k", now - 1), now=now)  # expired
    assert not session_valid("other", session_token("k", now + 60), now=now)  # the key changed
    for garbage in ("", "k", f"{now + 60}", f"{now + 60}.", "x.y", "9" * 40 + ".ab"):
        assert not session_valid("k", garbage, now=now), garbage


# ---- the monitor, piece by piece ----

def _monitor(client=None, workers: dict | None = None):
    from gateway.config import Settings
    from gateway.dashboard import Monitor
    from gateway.metrics import GatewayMetrics

    settings = Settings(model_dir=Path("/nonexistent/m"), gateway_id="gw-test")
    metrics = GatewayMetrics("m")
    admission = SimpleNamespace(snapshot=lambda: {"token_budget": {"total": 1000, "in_use": 250},
                                                  "requests": {"running": 2, "waiting": 1}})
    cluster = SimpleNamespace(workers=workers if workers is not None else {}, redis_ok=True, redis_error=None)
    return Monitor(settings, metrics, admission, cluster, client), metrics, cluster


def test_stream_backlog_sampling(redis_url):
    """XLEN, pending (delivered, not acked) and lag (not yet delivered) of each work stream."""
    import redis
    import redis.asyncio as aioredis

    from baton.common.protocol import DECODE_STREAM, PREFILL_STREAM

    url = redis_url.rsplit("/", 1)[0] + "/13"  # a database of our own
    sync = redis.Redis.from_url(url)
    sync.flushdb()
    sync.xgroup_create(PREFILL_STREAM, "prefill", id="$", mkstream=True)
    for i in range(5):
        sync.xadd(PREFILL_STREAM, {"p": i})
    sync.xreadgroup("prefill", "w1", {PREFILL_STREAM: ">"}, count=2)  # 2 delivered, 3 not yet
    sync.xadd(DECODE_STREAM, {"p": 0})  # a stream without its group yet: all of it is lag

    async def sample():
        client = aioredis.Redis.from_url(url)
        try:
            monitor, metrics, _ = _monitor(client)
            await monitor.sample_streams()
            return metrics
        finally:
            await client.aclose()

    metrics = asyncio.run(sample())
    assert metrics.streams == {"prefill": {"length": 5, "pending": 2, "lag": 3},
                               "decode": {"length": 1, "pending": 0, "lag": 1}}
    text = metrics.render().decode()
    assert 'baton:stream_lag{model_name="m",stream="prefill"} 3.0' in text
    assert 'baton:stream_pending{model_name="m",stream="prefill"} 2.0' in text
    assert 'baton:stream_length{model_name="m",stream="decode"} 1.0' in text
    sync.flushdb()
    sync.close()


def test_monitor_rates_percentiles_and_worker_health():
    now = time.time()
    workers = {"gateway": [{"worker_id": "gw-test", "time": now}],
               "prefill": [{"worker_id": "p0", "time": now - 0.5, "num_kv_blocks_used": 0, "num_kv_blocks_total": 8}],
               "decode": [{"worker_id": "d0", "time": now - 4, "num_kv_blocks_used": 3, "num_kv_blocks_total": 12,
                           "num_preemptions": 5, "num_requests_running": 2}]}
    monitor, metrics, cluster = _monitor(workers=workers)
    monitor.tick()
    for i in range(100):
        metrics.ttft.observe(0.001 * (i + 1))  # 1 .. 100 ms
    metrics.generation_tokens.inc(40)
    workers["decode"][0]["num_preemptions"] = 7
    time.sleep(0.05)
    monitor.tick()
    data = monitor.data()
    assert data["now"]["ttft_p50"] == pytest.approx(0.050) and data["now"]["ttft_p99"] == pytest.approx(0.099)
    assert data["now"]["itl_p50"] is None  # no sample: null, never NaN
    assert data["series"]["tokens_per_s"][-1] > 40  # 40 tokens in ~0.05 s
    assert data["series"]["preemptions_per_s"][-1] > 0 and data["now"]["preemptions"] == 7
    assert data["series"]["kv_usage"][-1] == pytest.approx(0.25)
    assert data["now"]["budget_in_use"] == 250 and data["now"]["running"] == 2 and data["now"]["waiting"] == 1
    status = {w["worker_id"]: w["status"] for w in data["workers"]}
    assert status == {"gw-test": "ok", "p0": "ok", "d0": "stale"}
    # The decode worker's heartbeat expires: it stays listed, as lost, for a while.
    cluster.workers = {"gateway": workers["gateway"], "prefill": workers["prefill"], "decode": []}
    rows = {w["worker_id"]: w for w in monitor.data()["workers"]}
    assert rows["d0"]["status"] == "lost" and rows["d0"]["age_s"] >= 4
    assert [w["kind"] for w in monitor.data()["workers"]] == ["gateway", "prefill", "decode"]


# ---- the screenshot for the docs ----

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve the real default model under load and screenshot /dashboard.")
    p.add_argument("--out", default="docs/dashboard.png")
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--load-seconds", type=float, default=100.0)
    p.add_argument("--clients", type=int, default=11)
    args = p.parse_args(argv)
    if CHROMIUM is None:
        print("chromium is not installed", file=sys.stderr)
        return 1
    from baton.common.model_files import resolve_model

    model = resolve_model(args.model)
    # A deliberately tight system, so the page has something to show: a small KV pool under a budget
    # bigger than it (preemptions), and fewer request slots than clients (some 429s).
    cluster = Cluster(model, prefill=1, decode=1, dtype="bfloat16",
                      gateway_args=("--max-concurrent-requests", str(args.clients - 1),
                                    "--max-batch-total-tokens", "4096"),
                      decode_args=("--num-kv-blocks", "80", "--scheduler-policy", "max-utilization"))
    try:
        prompts = ["Explain how a relay race works, step by step.", "Write a haiku about the sea.",
                   "What are the three primary colours?", "Describe the water cycle to a child.",
                   "Give me a recipe for pancakes.", "Why do leaves change colour in autumn?"]
        with Load(cluster.base_url, clients=args.clients, max_tokens=128, prompts=prompts, backoff_s=1.0) as load:
            time.sleep(args.load_seconds)
            httpx.post(cluster.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": -1})  # a 400
            time.sleep(2)
            shot = screenshot(cluster.base_url + "/dashboard", Path(args.out))
        print(f"wrote {shot} ({load.statuses})")
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
