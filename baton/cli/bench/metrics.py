"""Aggregation of per-request records into vLLM's serving metrics, and vLLM's printed result block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from baton.cli.bench.client import RequestOutput
from baton.cli.bench.datasets import SampleRequest

# (key, name in the block, section header), in vLLM's order.
METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class Distribution:
    """One latency metric in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (p, value)

    @classmethod
    def of(cls, seconds: list[float], percentiles: list[float]) -> "Distribution":
        # vLLM reports 0 for a metric with no samples (np.mean(x or 0)) rather than NaN.
        values = np.asarray(seconds or [0.0], dtype=float) * 1000
        return cls(float(np.mean(values)), float(np.median(values)), float(np.std(values)),
                   [(p, float(np.percentile(values, p))) for p in percentiles])


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    output_lens: list[int]  # 0 for a failed request, as vLLM
    dists: dict[str, Distribution] = field(default_factory=dict)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:300', 'tpot:50'] -> {'ttft': 300.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}; got {item!r}")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must not be negative")
        slos[key] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    return [float(p) for p in text.split(",") if p.strip()]


def count_output_tokens(out: RequestOutput, tokenizer: Any) -> int:
    # The server's count (usage) is exact; re-tokenizing the text is the fallback vLLM uses.
    if out.output_tokens is not None:
        return out.output_tokens
    return len(tokenizer.encode(out.generated_text, add_special_tokens=False))


def calculate_metrics(requests: list[SampleRequest], outputs: list[RequestOutput], duration: float,
                      tokenizer: Any, percentiles: list[float],
                      goodput: dict[str, float] | None = None) -> BenchmarkMetrics:
    output_lens: list[int] = []
    total_input = completed = good = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    for req, out in zip(requests, outputs):
        if not out.success:
            output_lens.append(0)
            continue
        n = count_output_tokens(out, tokenizer)
        output_lens.append(n)
        total_input += req.prompt_len
        completed += 1
        # TPOT excludes the first token; a one-token answer has none (vLLM leaves it out).
        tpot = (out.latency - out.ttft) / (n - 1) if n > 1 else None
        if tpot is not None:
            tpots.append(tpot)
        ttfts.append(out.ttft)
        itls.extend(out.itl)
        e2els.append(out.latency)
        if goodput:
            seen = {"ttft": out.ttft, "tpot": tpot or 0.0, "e2el": out.latency}
            if all(seen[k] * 1000 <= slo for k, slo in goodput.items()):
                good += 1
    total_output = sum(output_lens)
    d = duration if duration > 0 else float("nan")
    return BenchmarkMetrics(
        completed=completed, failed=len(outputs) - completed, duration=duration,
        total_input=total_input, total_output=total_output,
        request_throughput=completed / d,
        request_goodput=good / d if goodput else None,
        output_throughput=total_output / d,
        total_token_throughput=(total_input + total_output) / d,
        output_lens=output_lens,
        dists={"ttft": Distribution.of(ttfts, percentiles), "tpot": Distribution.of(tpots, percentiles),
               "itl": Distribution.of(itls, percentiles), "e2el": Distribution.of(e2els, percentiles)},
    )


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        return "{:<40} {:<10.2f}".format(label, value)
    return "{:<40} {:<10}".format(label, value)


def format_result(m: BenchmarkMetrics, selected: list[str], max_concurrency: int | None = None,
                  request_rate: float = float("inf")) -> str:
    """vLLM's result block, line for line (same labels, widths and order)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _row("Successful requests:", m.completed),
             _row("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", float(request_rate)))
    lines += [_row("Benchmark duration (s):", m.duration),
              _row("Total input tokens:", m.total_input),
              _row("Total generated tokens:", m.total_output),
              _row("Request throughput (req/s):", m.request_throughput)]
    if m.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", m.request_goodput))
    lines += [_row("Output token throughput (tok/s):", m.output_throughput),
              _row("Total Token throughput (tok/s):", m.total_token_throughput)]
    for key, name, header in METRICS:
        if key not in selected:
            continue
        dist = m.dists[key]
        lines += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                  _row(f"Mean {name} (ms):", dist.mean),
                  _row(f"Median {name} (ms):", dist.median)]
        lines += [_row(f"P{_p_word(p)} {name} (ms):", v) for p, v in dist.percentiles]
    lines.append("=" * 50)
    return "\n".join(lines)


def result_json(m: BenchmarkMetrics, outputs: list[RequestOutput], selected: list[str]) -> dict[str, Any]:
    """The metric part of vLLM's --save-result JSON (the caller adds date, backend, model_id, ...)."""
    result: dict[str, Any] = {
        "duration": m.duration, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": m.output_lens,
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "start_times": [o.start_time for o in outputs], "e2els": [o.latency for o in outputs],
        "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
    }
    for key, _, _ in METRICS:
        if key not in selected:
            continue
        dist = m.dists[key]
        result[f"mean_{key}_ms"] = dist.mean
        result[f"median_{key}_ms"] = dist.median
        result[f"std_{key}_ms"] = dist.std
        for p, v in dist.percentiles:
            result[f"p{_p_word(p)}_{key}_ms"] = v
    return result
