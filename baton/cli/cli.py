"""The `baton` command: `baton model fetch`, `baton serve`, `baton plan`, `baton bench`.

Process supervision lives in baton/cli/serve.py; this module only parses arguments and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys


def build_parser() -> argparse.ArgumentParser:
    from baton.common.env_flags import apply_env
    from baton.cli.serve import add_serve_arguments
    from baton.worker.args import (DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, KV_CACHE_DTYPE_HELP, QUANTIZATION_CHOICES,
                                   QUANTIZATION_HELP)

    parser = argparse.ArgumentParser(
        prog="baton",
        description="Baton: disaggregated LLM serving (prefill and decode pools over Redis).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    model = sub.add_parser("model", help="manage the default model")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION")
    model_sub.required = True
    fetch = model_sub.add_parser(
        "fetch", help="download and convert the default model once; print its directory (last line of stdout)"
    )
    fetch.add_argument("--force", action="store_true", help="download and convert again even if cached")

    serve = sub.add_parser(
        "serve", help="run gateway, prefill and decode workers (and a private Redis) on this machine"
    )
    add_serve_arguments(serve)
    apply_env(serve)  # every flag as BATON_<FLAG> too

    plan = sub.add_parser(
        "plan", help="load a model as a worker does and print what runs each step kind and projection, "
                     "and the bytes each weight holds")
    plan.add_argument("--model", default=None, help="as `baton serve --model` (default: the default model)")
    plan.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="as `baton serve --dtype`")
    plan.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES, help=QUANTIZATION_HELP)
    plan.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES, help=KV_CACHE_DTYPE_HELP)
    apply_env(plan)

    sub.add_parser("bench", help="benchmark a running Baton (arguments go to baton.cli.bench.cli)",
                   add_help=False)
    return parser


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from baton.common.model_files import fetch_default_model

    path = fetch_default_model(force=args.force)
    print(path, flush=True)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """The plan `prepare()` chose for this machine, after the load-time copies are freed (as in a
    worker: `baton.worker.shell.build_engine`), so the bytes are what a worker holds."""
    import logging
    from types import SimpleNamespace

    from baton.common.model_files import resolve_model
    from baton.worker.shell import build_engine

    logging.basicConfig(level="WARNING", format="%(message)s")
    worker_args = SimpleNamespace(model=str(resolve_model(args.model)), dtype=args.dtype, device=None, block_size=16,
                                  num_kv_blocks=16, kv_cache_memory=None, max_num_seqs=1, max_num_batched_tokens=512,
                                  threads=None, quantization=args.quantization,
                                  kv_cache_dtype=args.kv_cache_dtype, scheduler_policy="max-utilization",
                                  speculative_config=None)
    engine = build_engine(worker_args)
    print(engine.runtime.plan_report(), flush=True)
    return 0


def cmd_bench(argv: list[str]) -> int:
    try:
        bench = importlib.import_module("baton.cli.bench.cli")
    except ModuleNotFoundError as exc:
        if exc.name in ("baton.cli.bench", "baton.cli.bench.cli"):
            print("baton bench is not available in this version of Baton (no module baton.cli.bench.cli)",
                  file=sys.stderr)
            return 2
        raise
    result = bench.main(argv)
    return int(result or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "bench":
            # Everything after `bench` belongs to the benchmark's own parser.
            return cmd_bench(argv[1:])
        args = build_parser().parse_args(argv)
        if args.command == "model" and args.model_command == "fetch":
            return cmd_model_fetch(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "serve":
            from baton.cli.serve import run

            return run(args)
        return 2
    except KeyboardInterrupt:
        print("baton: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
