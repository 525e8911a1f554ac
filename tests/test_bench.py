"""`baton bench serve` / `sweep` against a whole system on the tiny model (vLLM's output shape)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.cluster import Cluster

BATON = str(Path(sys.executable).parent / "baton")
VLLM_KEYS = {
    "date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
    "itls", "generated_texts", "errors",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")),
}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with Cluster(tiny_model_dir, prefill=1, decode=1) as c:
        yield c


def generated_tokens(base_url: str) -> float:
    """The gateway's counter of generated tokens delivered (prometheus adds `_total`)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    match = re.search(r'^baton:generation_tokens_total\{model_name="[^"]*"\} (\S+)$', text, re.MULTILINE)
    assert match, "no baton:generation_tokens_total in /metrics"
    return float(match.group(1))


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([BATON, "bench", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_serve_matches_gateway_counter(cluster, tiny_model_dir, tmp_path):
    before = generated_tokens(cluster.base_url)
    proc = bench("serve", "--base-url", cluster.base_url, "--num-prompts", "12", "--random-input-len", "32",
                 "--random-output-len", "16", "--ignore-eos", "--max-concurrency", "4", "--save-result",
                 "--result-dir", str(tmp_path), "--tokenizer", str(tiny_model_dir), "--seed", "0",
                 "--disable-tqdm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "============ Serving Benchmark Result ============" in out
    assert re.search(r"^Successful requests:\s+12\s*$", out, re.MULTILINE), out
    assert re.search(r"^Failed requests:\s+0\s*$", out, re.MULTILINE), out
    assert re.search(r"^Maximum request concurrency:\s+4\s*$", out, re.MULTILINE), out
    for label in ("Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P99 E2EL (ms):",
                  "Output token throughput (tok/s):"):
        assert label in out

    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1, files
    result = json.loads(files[0].read_text())
    assert VLLM_KEYS <= result.keys(), VLLM_KEYS - result.keys()
    assert result["completed"] == 12 and result["failed"] == 0 and result["max_concurrency"] == 4
    # ignore_eos: every request generates exactly its max_tokens (16, range ratio 0).
    assert result["output_lens"] == [16] * 12
    assert result["total_output_tokens"] == generated_tokens(cluster.base_url) - before == 192
    assert all(len(itl) >= 1 for itl in result["itls"]) and all(t > 0 for t in result["ttfts"])


def test_bench_sweep_writes_csv_and_png(cluster, tiny_model_dir, tmp_path):
    proc = bench("sweep", "--base-url", cluster.base_url, "--num-prompts", "6", "--random-input-len", "16",
                 "--random-output-len", "8", "--ignore-eos", "--concurrency", "1,4", "--tokenizer",
                 str(tiny_model_dir), "--result-dir", str(tmp_path), "--result-filename", "sweep",
                 "--disable-tqdm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("Serving Benchmark Result") == 2
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["level"] for r in rows] == ["1", "4"]
    assert all(r["completed"] == "6" and r["failed"] == "0" for r in rows)
    assert float(rows[0]["output_throughput"]) > 0 and float(rows[1]["p99_tpot_ms"]) > 0
    png = (tmp_path / "sweep.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_bench_serve_grounded_dataset_sends_prompts_the_answer_repeats(cluster, tiny_model_dir, tmp_path):
    from baton.cli.bench.datasets import PASSAGES, load_tokenizer, sample_grounded_requests

    tokenizer = load_tokenizer(tiny_model_dir)
    requests = sample_grounded_requests(tokenizer, 6, 8, seed=1)
    assert len({r.prompt for r in requests}) == 6
    for r in requests:  # chat-formatted, with a whole passage inside it, counted with the tokenizer
        assert r.prompt.startswith("<|im_start|>") and r.prompt.endswith("<|im_start|>assistant\n")
        assert any(p in r.prompt for p in PASSAGES) and r.expected_output_len == 8
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False)) > 40
    before = generated_tokens(cluster.base_url)
    proc = bench("serve", "--base-url", cluster.base_url, "--dataset-name", "grounded", "--num-prompts", "4",
                 "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "2", "--save-result",
                 "--result-dir", str(tmp_path), "--tokenizer", str(tiny_model_dir), "--disable-tqdm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert result["completed"] == 4 and result["output_lens"] == [8] * 4
    assert result["total_output_tokens"] == generated_tokens(cluster.base_url) - before == 32
    assert min(result["input_lens"]) > 40


def test_bench_serve_drives_chat_with_an_api_key(default_model_dir, gw_redis_url, gw_tokenizer, gw_worker, tmp_path):
    """vLLM's `--backend openai-chat` (or `--endpoint /v1/chat/completions`) against a gateway that
    wants a key: the key comes from $BATON_API_KEY (or --api-key) as a Bearer token, each prompt
    goes as one user message (the gateway applies the chat template)."""
    from tests.test_gateway_support import start_gateway

    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, api_key="s3cret")
    try:
        common = ("serve", "--base-url", server.url, "--num-prompts", "4", "--random-input-len", "16",
                  "--random-output-len", "5", "--tokenizer", str(default_model_dir), "--disable-tqdm")
        refused = bench(*common, "--backend", "openai-chat")
        assert refused.returncode != 0 and "401" in refused.stdout + refused.stderr  # no key: /v1/models says 401

        before = len(gw_worker.requests)
        proc = subprocess.run([BATON, "bench", *common, "--backend", "openai-chat", "--save-result",
                               "--result-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, BATON_API_KEY="s3cret", HF_HUB_OFFLINE="1"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result = json.loads(next(tmp_path.glob("*.json")).read_text())
        assert result["backend"] == "openai-chat" and result["completed"] == 4 and result["failed"] == 0
        assert result["output_lens"] == [5] * 4  # max_completion_tokens reached the gateway
        sent = gw_worker.requests[before:]
        assert len(sent) == 4
        for req in sent:  # the chat template wrapped each prompt: a user turn, then the assistant's
            text = gw_tokenizer.hf.decode(req.prompt_token_ids)
            assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n"), text[-80:]

        # --endpoint names the same API; --api-key gives the key on the command line
        proc = bench(*common, "--endpoint", "/v1/chat/completions", "--api-key", "s3cret")
        assert proc.returncode == 0 and re.search(r"^Successful requests:\s+4\s*$", proc.stdout, re.MULTILINE), \
            proc.stdout + proc.stderr
    finally:
        server.stop()
