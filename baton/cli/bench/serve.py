"""`baton bench serve`: send a workload at a given rate / concurrency, measure, report, save."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from baton.cli.bench.client import RequestInput, RequestOutput, fetch_first_model, make_client, request_completion
from baton.cli.bench.datasets import (SampleRequest, load_tokenizer, sample_file_requests, sample_grounded_requests,
                                      sample_random_requests)
from baton.cli.bench.metrics import (BenchmarkMetrics, calculate_metrics, format_result, parse_goodput,
                                 parse_percentiles, result_json)


@dataclass
class RunResult:
    outputs: list[RequestOutput]
    duration: float


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: Poisson arrivals (exponential gaps) for burstiness 1.

    vLLM draws gaps from a gamma distribution of shape `burstiness` and mean 1/rate; they are drawn
    up front from their own seeded generator so the schedule does not depend on the dataset.
    """
    if request_rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("/chat/completions")


async def run_requests(base_url: str, model: str, requests: list[SampleRequest], request_rate: float = float("inf"),
                       max_concurrency: int | None = None, ignore_eos: bool = False, seed: int = 0,
                       burstiness: float = 1.0, disable_tqdm: bool = False, endpoint: str = COMPLETIONS,
                       api_key: str | None = None) -> RunResult:
    """Send every request on its schedule, at most `max_concurrency` in flight; time the whole run.
    A `.../chat/completions` endpoint gets each prompt as one user message."""
    from tqdm import tqdm

    api_url = base_url.rstrip("/") + endpoint
    chat = is_chat(endpoint)
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    # The semaphore models clients that wait for an answer before sending again (closed loop);
    # a request's clock starts when it gets a slot, as in vLLM, so TTFT excludes client queueing.
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = tqdm(total=len(requests), disable=disable_tqdm)
    async with make_client(max_concurrency, api_key) as client:
        start = time.perf_counter()

        async def one(req: SampleRequest, offset: float) -> RequestOutput:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = req.chat_prompt if chat and req.chat_prompt is not None else req.prompt
            inp = RequestInput(prompt, req.prompt_len, req.expected_output_len, model, api_url, ignore_eos, chat)
            if semaphore is None:
                out = await request_completion(client, inp, start)
            else:
                async with semaphore:
                    out = await request_completion(client, inp, start)
            pbar.update(1)
            return out

        outputs = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        duration = time.perf_counter() - start
    pbar.close()
    return RunResult(list(outputs), duration)


def resolve_model_name(base_url: str, model: str | None, api_key: str | None = None) -> str:
    if model:
        return model

    async def ask() -> str:
        async with make_client(api_key=api_key) as client:
            return await fetch_first_model(client, base_url)

    return asyncio.run(ask())


def load_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    if args.dataset_name == "file":
        if not args.prompts_file:
            raise SystemExit("--dataset-name file needs --prompts-file")
        return sample_file_requests(args.prompts_file, tokenizer, args.num_prompts, args.random_output_len)
    if args.dataset_name == "grounded":
        return sample_grounded_requests(tokenizer, args.num_prompts, args.random_output_len, args.seed)
    return sample_random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, args.seed,
                                  output_range_ratio=getattr(args, "random_output_range_ratio", None))


def parse_rate(text: str) -> float:
    rate = float(text)  # float("inf") parses "inf"
    if rate <= 0:
        raise argparse.ArgumentTypeError("the request rate must be > 0 (or inf)")
    return rate


def default_result_name(model: str, request_rate: float, max_concurrency: int | None, date: str) -> str:
    # vLLM's file name: {backend}-{rate}qps[-concurrency{n}]-{model}-{date}.json
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"openai-{request_rate}qps{conc}-{model.split('/')[-1]}-{date}.json"


def benchmark_level(args: argparse.Namespace, tokenizer: Any, model: str, requests: list[SampleRequest],
                    request_rate: float, max_concurrency: int | None) -> tuple[BenchmarkMetrics, dict[str, Any]]:
    """One run at one load level: send, aggregate, print vLLM's block, save / plot if asked."""
    percentiles = parse_percentiles(args.metric_percentiles)
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    goodput = parse_goodput(args.goodput)
    print(f"Traffic request rate: {request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({'Poisson process' if args.burstiness == 1 else 'Gamma distribution'})")
    print(f"Maximum request concurrency: {max_concurrency}")
    run = asyncio.run(run_requests(args.base_url, model, requests, request_rate, max_concurrency, args.ignore_eos,
                                   args.seed, args.burstiness, args.disable_tqdm, args.endpoint, args.api_key))
    metrics = calculate_metrics(requests, run.outputs, run.duration, tokenizer, percentiles, goodput)
    print(format_result(metrics, selected, max_concurrency, request_rate), flush=True)
    errors = [o.error for o in run.outputs if o.error]
    if errors:
        print(f"First error ({len(errors)} failed): {errors[0]}")
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    result: dict[str, Any] = {
        "date": date, "backend": "openai-chat" if is_chat(args.endpoint) else "openai", "model_id": model,
        "tokenizer_id": str(args.tokenizer_id),
        "num_prompts": len(requests), "request_rate": request_rate if request_rate != float("inf") else "inf",
        "burstiness": args.burstiness, "max_concurrency": max_concurrency,
        **result_json(metrics, run.outputs, selected),
    }
    if args.save_result or args.plot:
        result_dir = Path(args.result_dir or ".")
        result_dir.mkdir(parents=True, exist_ok=True)
        name = args.result_filename or default_result_name(model, request_rate, max_concurrency, date)
        path = result_dir / name
        if args.save_result:
            path.write_text(json.dumps(result))
            print(f"Saved result to {path}")
        if args.plot:
            from baton.cli.bench.plots import plot_run

            for png in plot_run(run.outputs, metrics.output_lens, run.duration, path.with_suffix("")):
                print(f"Saved plot to {png}")
    return metrics, result


def resolve_endpoint(args: argparse.Namespace) -> None:
    """vLLM's pair: `--backend openai-chat` means /v1/chat/completions unless --endpoint names it."""
    backend = getattr(args, "backend", None)
    if args.endpoint is None:
        args.endpoint = CHAT_COMPLETIONS if backend == "openai-chat" else COMPLETIONS
    if not args.endpoint.startswith("/"):
        raise SystemExit(f"--endpoint is a path, e.g. {CHAT_COMPLETIONS} (got {args.endpoint!r})")
    if backend is not None and (backend == "openai-chat") != is_chat(args.endpoint):
        raise SystemExit(f"--backend {backend} does not go with --endpoint {args.endpoint}")


def prepare(args: argparse.Namespace) -> tuple[Any, str, list[SampleRequest]]:
    """Tokenizer, model name and the workload: shared by serve and sweep (a sweep samples once)."""
    resolve_endpoint(args)
    if args.tokenizer is None:
        from baton.common.model_files import default_model_dir

        args.tokenizer = str(default_model_dir())
    args.tokenizer_id = args.tokenizer
    parse_goodput(args.goodput)  # fail on a bad flag before any work
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (OSError, ValueError) as exc:  # not a tokenizer directory (e.g. the default model was never fetched)
        raise SystemExit(f"baton bench: cannot load a tokenizer from {args.tokenizer}: {exc}\n"
                         "(pass --tokenizer DIR, or run `baton model fetch` for the default model)") from None
    try:
        model = resolve_model_name(args.base_url, args.model, args.api_key)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"baton bench: cannot read the model name from {args.base_url}/v1/models "
                         f"({type(exc).__name__}: {exc}); is the server up? (or pass --model)") from None
    requests = load_requests(args, tokenizer)
    return tokenizer, model, requests


def run_serve(args: argparse.Namespace) -> int:
    tokenizer, model, requests = prepare(args)
    metrics, _ = benchmark_level(args, tokenizer, model, requests, args.request_rate, args.max_concurrency)
    return 0 if metrics.completed > 0 else 1
