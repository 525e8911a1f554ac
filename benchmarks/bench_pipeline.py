"""The disaggregated pipeline against the colocated engine, on the same workload, in one run.

1. samples N random prompts (vLLM's random dataset: 128-256 input tokens, 64-128 output tokens by
   default), greedy with ignore_eos so both sides generate exactly the same number of tokens;
2. starts the whole pipeline (private redis, 1 prefill + 1 decode worker with 1 torch thread each,
   gateway), drives it over HTTP with `baton bench serve`'s own functions (streaming, at most
   --max-concurrency requests in flight), prints vLLM's result block, and reads the workers'
   Prometheus metrics before and after to say where the pipeline's time went;
3. stops it, runs the same token ids through the colocated in-process engine (`baton.LLM`,
   at most --max-concurrency sequences per batch), once per --colocated-threads value (2, then 1:
   on 2 cores that other processes also use, 2 torch threads can collapse, 1 rarely does);
4. prints the output tokens/s of each and the ratio pipeline / colocated.

    python benchmarks/bench_pipeline.py                  # real SmolLM2-135M, bf16, 32 prompts
    python benchmarks/bench_pipeline.py --num-prompts 8 --output-len 32   # smoke run

Both sides get the same CPU budget on a 2-core machine (1 + 1 worker threads vs 2 threads), but the
pipeline's gateway, redis and this benchmark client also run on those cores. Each side is warmed
up with two short requests first, outside the timed run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton.cli.bench.datasets import SampleRequest, load_tokenizer, sample_random_requests  # noqa: E402
from baton.cli.bench.metrics import calculate_metrics, format_result  # noqa: E402
from baton.cli.bench.serve import run_requests  # noqa: E402
from baton.common.model_files import resolve_model  # noqa: E402
from baton.cli.redis_server import free_port  # noqa: E402

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def loadavg() -> str:
    try:
        one, five, _ = os.getloadavg()
        return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"
    except OSError:
        return "load average unknown"


def scrape(url: str) -> Samples:
    """Every sample of a Prometheus endpoint, keyed by (name, labels without model_name)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10, trust_env=False).text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def hist(after: Samples, before: Samples, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram over the interval."""
    return delta(after, before, name + "_count"), delta(after, before, name + "_sum")


def hist_quantile(after: Samples, before: Samples, name: str, q: float) -> float:
    """Prometheus' histogram_quantile over the interval: linear within the bucket that holds q."""
    buckets = sorted(
        (float(dict(labels)["le"]), after[(n, labels)] - before.get((n, labels), 0.0))
        for (n, labels) in after if n == name + "_bucket")
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


def warmup_requests(tokenizer, seed: int) -> list[SampleRequest]:
    # First forward passes pay one-off costs (allocator, kernels): keep them out of the timed run.
    return sample_random_requests(tokenizer, 2, 32, 8, 0.0, seed + 1)


def run_pipeline(args: argparse.Namespace, model_dir: Path, tokenizer, requests: list[SampleRequest]) -> dict:
    from tests.cluster import Cluster

    prefill_port, decode_port = free_port(), free_port()
    started = time.perf_counter()
    cluster = Cluster(model_dir, prefill=1, decode=1, dtype=args.dtype,
                      prefill_args=("--metrics-port", str(prefill_port)),
                      decode_args=("--metrics-port", str(decode_port)))
    try:
        print(f"pipeline up in {time.perf_counter() - started:.1f} s at {cluster.base_url} "
              f"(worker metrics on :{prefill_port}, :{decode_port}; logs in {cluster.log_dir})")
        model_name = httpx.get(cluster.base_url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        asyncio.run(run_requests(cluster.base_url, model_name, warmup_requests(tokenizer, args.seed),
                                 max_concurrency=2, ignore_eos=True, disable_tqdm=True))
        urls = {"gateway": cluster.base_url + "/metrics", "prefill": f"http://127.0.0.1:{prefill_port}/metrics",
                "decode": f"http://127.0.0.1:{decode_port}/metrics"}
        before = {k: scrape(u) for k, u in urls.items()}
        run = asyncio.run(run_requests(cluster.base_url, model_name, requests, float("inf"), args.max_concurrency,
                                       ignore_eos=True, seed=args.seed, disable_tqdm=True))
        after = {k: scrape(u) for k, u in urls.items()}
    finally:
        cluster.stop()
    metrics = calculate_metrics(requests, run.outputs, run.duration, tokenizer, [50.0, 99.0])
    print(format_result(metrics, ["ttft", "tpot", "itl", "e2el"], args.max_concurrency))
    if metrics.failed:
        print("first error:", next(o.error for o in run.outputs if o.error))
    return {"metrics": metrics, "before": before, "after": after}


def print_breakdown(p: dict) -> None:
    """Where the pipeline's wall time went, from the workers' and the gateway's metrics."""
    m, before, after = p["metrics"], p["before"], p["after"]
    wall = m.duration
    pb, pa, db, da, gb, ga = (before["prefill"], after["prefill"], before["decode"], after["decode"],
                              before["gateway"], after["gateway"])
    print("\nWhere the pipeline's time goes (deltas of Prometheus metrics over the timed run)")
    p_steps, p_busy = hist(pa, pb, "baton:worker_engine_step_seconds")
    d_steps, d_busy = hist(da, db, "baton:worker_engine_step_seconds")
    d_tok_steps, d_tokens = hist(da, db, "baton:worker_iteration_tokens_total")
    p_req, p_time = hist(pa, pb, "baton:worker_request_prefill_time_seconds")
    d_req, d_time = hist(da, db, "baton:worker_request_decode_time_seconds")
    h_n, h_sum = hist(da, db, "baton:worker_kv_handoff_latency_seconds")
    q_n, q_sum = hist(ga, gb, "baton:request_queue_time_seconds")
    written = delta(pa, pb, "baton:worker_kv_handoff_bytes_total", direction="written")
    fetched = delta(da, db, "baton:worker_kv_handoff_bytes_total", direction="fetched")
    mib = 1 << 20
    rows = [
        ("benchmark wall time", f"{wall:.2f} s"),
        ("prefill worker busy (sum of engine steps)",
         f"{p_busy:.2f} s = {100 * p_busy / wall:.0f}% of wall, {p_steps:.0f} steps, "
         f"mean {1000 * p_busy / max(p_steps, 1):.1f} ms/step"),
        ("decode worker busy (sum of engine steps)",
         f"{d_busy:.2f} s = {100 * d_busy / wall:.0f}% of wall, {d_steps:.0f} steps, "
         f"mean {1000 * d_busy / max(d_steps, 1):.1f} ms/step, "
         f"mean {d_tokens / max(d_tok_steps, 1):.1f} tokens/step"),
        ("prefill time per request (worker)", f"mean {1000 * p_time / max(p_req, 1):.1f} ms over {p_req:.0f}"),
        ("decode time per request (worker)", f"mean {1000 * d_time / max(d_req, 1):.1f} ms over {d_req:.0f}"),
        ("gateway admission queue time", f"mean {1000 * q_sum / max(q_n, 1):.1f} ms"),
        ("TTFT (client) - prefill time (worker)",
         f"{m.dists['ttft'].mean - 1000 * p_time / max(p_req, 1):.1f} ms mean: waiting for the prefill "
         "worker + gateway/redis/HTTP"),
        ("KV handoff: first token -> decode admission",
         f"mean {1000 * h_sum / max(h_n, 1):.1f} ms, p50 ~{1000 * hist_quantile(da, db, 'baton:worker_kv_handoff_latency_seconds', 0.5):.0f} ms, "
         f"p99 ~{1000 * hist_quantile(da, db, 'baton:worker_kv_handoff_latency_seconds', 0.99):.0f} ms over {h_n:.0f}"),
        ("KV bytes through the store",
         f"{written / mib:.1f} MiB written by prefill, {fetched / mib:.1f} MiB fetched by decode "
         f"({written / max(m.total_input, 1) / 1024:.1f} KiB per prompt token)"),
        ("TPOT (client) vs decode step (worker)",
         f"{m.dists['tpot'].mean:.1f} ms vs {1000 * d_busy / max(d_steps, 1):.1f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def run_colocated(args: argparse.Namespace, model_dir: Path, tokenizer, requests: list[SampleRequest],
                  threads: int) -> dict:
    from baton import LLM, SamplingParams

    # The gateway tokenizes text prompts with the tokenizer's default special tokens: same ids here.
    prompts = [tokenizer(r.prompt)["input_ids"] for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.expected_output_len, ignore_eos=True) for r in requests]
    started = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype=args.dtype, num_threads=threads,
              max_num_seqs=args.colocated_max_num_seqs or args.max_concurrency)
    print(f"\ncolocated engine loaded in {time.perf_counter() - started:.1f} s "
          f"({threads} threads, max_num_seqs {args.colocated_max_num_seqs or args.max_concurrency})")
    warm = warmup_requests(tokenizer, args.seed)
    llm.generate([tokenizer(r.prompt)["input_ids"] for r in warm],
                 [SamplingParams(temperature=0, max_tokens=r.expected_output_len, ignore_eos=True) for r in warm])
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm  # free its KV pool before the next run
    print(f"colocated ({threads} threads): {len(outputs)} requests, {sum(map(len, prompts))} input tokens, "
          f"{generated} output tokens in {seconds:.2f} s")
    return {"seconds": seconds, "output_tokens": generated}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--range-ratio", type=float, default=1 / 3,
                    help="lengths uniform in [len*(1-r), len*(1+r)]: 128-256 in, 64-128 out by default")
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--colocated-threads", default="2,1",
                    help="torch threads of the colocated engine; a list runs it once per value (the first "
                         "is the headline ratio). 1 is there because 2 threads on 2 busy cores collapse")
    ap.add_argument("--colocated-max-num-seqs", type=int, default=None, help="default: --max-concurrency")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    requests = sample_random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                                      args.range_ratio, args.seed)
    print(f"model {model_dir} ({args.dtype}); {len(requests)} prompts, "
          f"{sum(r.prompt_len for r in requests)} input tokens "
          f"({min(r.prompt_len for r in requests)}-{max(r.prompt_len for r in requests)}), "
          f"{sum(r.expected_output_len for r in requests)} output tokens "
          f"({min(r.expected_output_len for r in requests)}-{max(r.expected_output_len for r in requests)}), "
          f"max concurrency {args.max_concurrency}")
    print(f"before: {loadavg()}")
    pipeline = run_pipeline(args, model_dir, tokenizer, requests)
    print_breakdown(pipeline)
    threads = [int(t) for t in args.colocated_threads.split(",") if t.strip()]
    colocated = {t: run_colocated(args, model_dir, tokenizer, requests, t) for t in threads}
    print(f"after: {loadavg()}")

    p_tps = pipeline["metrics"].output_throughput
    print("\n=============== Pipeline vs colocated ===============")
    print("{:<40} {:<10.2f}".format("Pipeline output tokens/s (1+1 threads):", p_tps))
    for t, c in colocated.items():
        c_tps = c["output_tokens"] / c["seconds"]
        print("{:<40} {:<10.2f}".format(f"Colocated output tokens/s ({t} threads):", c_tps))
        print("{:<40} {:<10.2f}".format(f"Ratio pipeline / colocated ({t} threads):", p_tps / c_tps))
    print("=" * 53)
    return 0 if pipeline["metrics"].failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
