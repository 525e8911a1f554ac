"""`baton bench serve` and `baton bench sweep`: flags in the shape of `vllm bench serve`."""

from __future__ import annotations

import argparse
import os
import sys

from baton.cli.bench.serve import parse_rate


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (POSTs to --endpoint)")
    p.add_argument("--endpoint", default=None,
                   help="path requests go to: /v1/completions (a prompt) or /v1/chat/completions (the prompt as "
                        "one user message) (default /v1/completions; with --backend openai-chat the chat one)")
    p.add_argument("--backend", choices=["openai", "openai-chat"], default=None,
                   help="vLLM's name for the API: openai-chat is /v1/chat/completions (default: from --endpoint)")
    p.add_argument("--api-key", default=os.environ.get("BATON_API_KEY") or os.environ.get("OPENAI_API_KEY") or None,
                   help="sent as 'Authorization: Bearer KEY' (default: $BATON_API_KEY, else $OPENAI_API_KEY; "
                        "prefer the variable: a flag is visible to every local user in `ps`)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer directory to count tokens (default: Baton's default model)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=parse_rate, default=float("inf"),
                   help="requests/s with Poisson arrivals, or inf to send all at once (default inf)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset-name", choices=["random", "grounded", "file"], default="random",
                   help="random token prompts; grounded: chat prompts asking to repeat or rewrite a passage "
                        "(the answer repeats the prompt: where speculative decoding pays); file: --prompts-file")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128,
                   help="max_tokens of random prompts; also of file prompts without their own max_tokens")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--random-output-range-ratio", type=float, default=None,
                   help="the same for output lengths only (default: --random-range-ratio); 0: exactly "
                        "--random-output-len tokens each")
    p.add_argument("--prompts-file", default=None,
                   help='JSON lines with "prompt" (and optional "max_tokens"), or one plain-text prompt a line')
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: generate exactly max_tokens")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (a request is good if within all)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    p.add_argument("--save-result", action="store_true", help="write the result JSON (vLLM's keys)")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", action="store_true", help="write PNG charts (latency CDFs, tokens/s over time)")
    p.add_argument("--disable-tqdm", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton bench", description="Benchmark an OpenAI-compatible server.")
    sub = parser.add_subparsers(dest="bench_command", metavar="COMMAND")
    sub.required = True
    serve = sub.add_parser("serve", help="one run: latency and throughput at one load level")
    add_serve_arguments(serve)
    sweep = sub.add_parser("sweep", help="bench serve at several load levels; a CSV and a latency-vs-throughput PNG")
    add_serve_arguments(sweep)
    levels = sweep.add_mutually_exclusive_group()
    levels.add_argument("--concurrency", default=None, help="max-concurrency levels (default 1,4,16,64)")
    levels.add_argument("--request-rates", default=None, help="request-rate levels, e.g. 1,2,4,inf")
    sweep.add_argument("--sweep-latency", choices=["tpot", "e2el"], default="tpot",
                       help="latency on the PNG's y axis (median and p99)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.bench_command == "serve":
        from baton.cli.bench.serve import run_serve

        return run_serve(args)
    from baton.cli.bench.sweep import run_sweep

    return run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
