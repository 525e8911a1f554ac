"""PNG charts of a run (latency CDFs, output tokens/s over time) and of a sweep (Orca's curve)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from baton.cli.bench.client import RequestOutput


def _pyplot() -> Any:
    # Imported lazily (matplotlib is only needed for --plot) and headless.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(values_ms)
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")


def token_times(outputs: list[RequestOutput], output_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(time since start, tokens) of every chunk with text.

    A chunk may carry several tokens and the stream does not say how many, so a request's token
    count is spread evenly over its chunks: exact totals, approximate timing within a request.
    """
    times: list[float] = []
    counts: list[float] = []
    for out, n in zip(outputs, output_lens):
        if not out.success or n == 0:
            continue
        stamps = out.start_time + out.ttft + np.concatenate([[0.0], np.cumsum(out.itl)])
        times.extend(stamps.tolist())
        counts.extend([n / len(stamps)] * len(stamps))
    return np.asarray(times), np.asarray(counts)


def plot_run(outputs: list[RequestOutput], output_lens: list[int], duration: float, stem: Path) -> list[Path]:
    """Write `<stem>-latency.png` (CDFs of TTFT, TPOT, ITL, E2EL) and `<stem>-throughput.png`."""
    plt = _pyplot()
    ok = [(o, n) for o, n in zip(outputs, output_lens) if o.success]
    ttft = [o.ttft * 1000 for o, _ in ok]
    tpot = [(o.latency - o.ttft) / (n - 1) * 1000 for o, n in ok if n > 1]
    itl = [g * 1000 for o, _ in ok for g in o.itl]
    e2el = [o.latency * 1000 for o, _ in ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, values, title in zip(axes.flat, (ttft, tpot, itl, e2el),
                                 ("Time to first token", "Time per output token", "Inter-token latency",
                                  "End-to-end latency")):
        _cdf(ax, values, title)
    fig.tight_layout()
    latency_png = stem.parent / f"{stem.name}-latency.png"
    fig.savefig(latency_png, dpi=100)
    plt.close(fig)

    times, counts = token_times(outputs, output_lens)
    width = max(duration / 50, 0.1)  # ~50 bins whatever the run's length
    edges = np.arange(0.0, max(duration, width) + width, width)
    tokens, _ = np.histogram(times, bins=edges, weights=counts)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(edges[:-1] + width / 2, tokens / width)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Output token throughput over time ({width:.2f} s bins)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    throughput_png = stem.parent / f"{stem.name}-throughput.png"
    fig.savefig(throughput_png, dpi=100)
    plt.close(fig)
    return [latency_png, throughput_png]


def plot_sweep(rows: list[dict[str, Any]], kind: str, latency: str, path: Path) -> Path:
    """Throughput on x, median and p99 latency on y, each point labelled with its load level.

    This is the curve of Orca's evaluation: how much latency each extra token/s costs.
    """
    plt = _pyplot()
    name = {"tpot": "time per output token", "e2el": "end-to-end latency"}[latency]
    xs = [r["output_throughput"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    for stat, marker in (("median", "o-"), ("p99", "s--")):
        ys = [r[f"{stat}_{latency}_ms"] for r in rows]
        ax.plot(xs, ys, marker, label=f"{stat} {latency.upper()}")
        for x, y, r in zip(xs, ys, rows):
            ax.annotate(str(r["level"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("output token throughput (tok/s)")
    ax.set_ylabel(f"{name} (ms)")
    ax.set_title(f"Latency vs throughput (points labelled with {kind})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
