"""Command-line flags every worker takes, and how a worker process reads its `WorkerConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from baton.common.service_config import SERVICE_CONFIG_ENV
from baton.worker.config import WorkerConfig

if TYPE_CHECKING:
    from baton.worker.shell import WorkerShell


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"  # the services' (a local Redis), when $REDIS_URL is unset
# What baton.model.loader.resolve_dtype loads weights as (auto: bf16 where it is fast, else fp32).
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]
# baton.model.quant.QUANTIZATIONS (not imported here: parsing flags must not load torch)
QUANTIZATION_CHOICES = ["auto", "none", "int8", "int4"]
QUANTIZATION_HELP = ("weights: auto (the default: a model converted from a GGUF keeps its own quantization, "
                     "Q8_0 / Q4_0 / Q4_1 / Q4_K as they are and other types requantized to Q8_0; any other model "
                     "in --dtype), none (in --dtype; a GGUF dequantized), int8 (Q8_0 blocks of 32) or int4 (Q4_1 "
                     "blocks of 32), both quantized at load")
# baton.model.kv_quant.KV_CACHE_DTYPES (not imported here: parsing flags must not load torch)
KV_CACHE_DTYPE_CHOICES = ["auto", "int8", "fp8", "fp8_e4m3"]
KV_CACHE_DTYPE_HELP = ("the KV cache: auto (the model's dtype), int8 or fp8 (= fp8_e4m3): one byte a value and an fp32 "
                       "scale per token and head, about half of bf16's memory and handoff bytes")


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MB)")
    number, unit, binary = match.groups()
    base = 1024 if binary or not unit else 1000
    return int(float(number) * base ** " KMGT".index(unit.upper() or " "))


def speculative_config_arg(text: str) -> object:
    """`--speculative-config` JSON -> a SpeculativeConfig (None when empty); argparse's error
    names what is wrong."""
    from baton.engine.speculative_config import parse_speculative_config  # no torch: plain parsing

    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_common_args(parser: argparse.ArgumentParser, kind: str) -> None:
    parser.add_argument("--model", default=None,
                        help="model directory, .gguf, or Hub repo id (default: the default model)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                        help="redis[s]://, redis[s]+cluster:// or redis[s]+sentinel:// (default: $REDIS_URL, "
                             "else redis://127.0.0.1:6379/0)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                        help=QUANTIZATION_HELP)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES, help=KV_CACHE_DTYPE_HELP)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (workers on one machine must share its cores)")
    parser.add_argument("--core-share", default=None, metavar="PATH",
                        help="the core-share ledger `baton serve` made for the workers of this machine: an idle "
                             "prefill worker lends its threads to a decode worker (baton/worker/thread_lending.py)")
    parser.add_argument("--core-share-slot", type=int, default=0, help="this worker's record in --core-share")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    # --kv-cache-memory-bytes: vLLM's name for it, so vLLM command lines work unchanged
    parser.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_bytes, default=parse_bytes("1GiB"),
                        help="KV pool size when --num-kv-blocks is not given (e.g. 2GiB, or bytes)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--metrics-host", default=os.environ.get("BATON_METRICS_HOST", "127.0.0.1"),
                        help="address the metrics port binds (default loopback; 0.0.0.0 in a container)")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--claim-idle-ms", type=int, default=15000,
                        help="a message unacked this long by a consumer whose heartbeat stopped is claimed")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work on SIGTERM")
    parser.add_argument("--gateway-grace", type=float, default=15.0,
                        help="seconds without a gateway heartbeat before its requests are dropped as orphans")
    parser.add_argument("--log-level", default=os.environ.get("BATON_LOG_LEVEL", "INFO"))
    parser.add_argument("--log-format", default=os.environ.get("BATON_LOG_FORMAT", "text"), choices=["text", "json"],
                        help="text lines or one JSON object per line (default: $BATON_LOG_FORMAT, else text)")
    parser.add_argument("--stall-timeout", type=float, default=float(os.environ.get("BATON_STALL_TIMEOUT", 60.0)),
                        help="GET /health on the metrics port answers 503 when the worker's loop has not "
                             "turned for this many seconds (default: $BATON_STALL_TIMEOUT, else 60)")


def add_kind_args(parser: argparse.ArgumentParser, kind: str) -> None:
    """The flags of one kind of worker only (here, not in its package: `baton serve` reads their
    defaults without importing a worker, which loads torch)."""
    if kind == "prefill":
        parser.add_argument("--pooling-step-tokens", type=int, default=None,
                            help="embeddings input tokens per engine step; a chat prompt that arrives meanwhile "
                                 "waits for that step, then runs alone (default: --max-num-batched-tokens / 8)")
    elif kind == "decode":
        parser.add_argument("--scheduler-policy", default="max-utilization", choices=["max-utilization", "no-evict"])
        parser.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                            help='speculative decoding as JSON in vLLM\'s shape, e.g. \'{"method": "ngram", '
                                 '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                                 "(default: off)")
    else:
        raise ValueError(f"no worker kind {kind!r}")


def worker_parser(kind: str, environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """`python -m <kind>_worker`'s flags, each also a BATON_<FLAG> variable (of `environ`, default
    this process's environment)."""
    from baton.common.env_flags import apply_env

    parser = argparse.ArgumentParser(prog=f"python -m {kind}_worker", description=f"Baton {kind} worker")
    add_common_args(parser, kind)
    add_kind_args(parser, kind)
    apply_env(parser, environ)  # every flag as BATON_<FLAG> too
    return parser


def parse_worker_config(kind: str, argv: list[str] | None,
                        environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """The worker's config: from $BATON_SERVICE_CONFIG when set (`baton serve` sets it; then no
    flags are taken), else from its flags. A bad config exits with a usage error, as a bad flag does."""
    environ = os.environ if environ is None else environ
    parser = worker_parser(kind, environ)
    text = environ.get(SERVICE_CONFIG_ENV)
    if text is None:
        return WorkerConfig.from_args(parser.parse_args(argv))
    if sys.argv[1:] if argv is None else argv:
        parser.error(f"no flags are taken with {SERVICE_CONFIG_ENV} set: it holds the whole config")
    try:
        return WorkerConfig.from_json(text, redis_url=environ.get("REDIS_URL", DEFAULT_REDIS_URL))
    except ValueError as exc:
        parser.error(str(exc))


def run_worker(worker_class: type[WorkerShell], argv: list[str] | None) -> None:
    """Read a worker's config and run it on uvloop (`python -m prefill_worker` / `decode_worker`)."""
    import asyncio

    from baton.common.logs import setup_logging
    from baton.common.model_files import resolve_model
    from baton.common.tracing import setup_tracing

    kind = worker_class.kind
    config = parse_worker_config(kind, argv)
    setup_logging(config.log_level, config.log_format)
    setup_tracing(f"baton-{kind}-worker")  # only with an OTLP endpoint set and OpenTelemetry installed
    try:  # before the worker starts: an unknown model is a message, not a traceback from its loop
        config = dataclasses.replace(config, model=str(resolve_model(config.model)))
        if config.speculative_config is not None:  # a draft model: a name too
            from baton.engine.speculative_config import with_draft_dir

            config = dataclasses.replace(config, speculative_config=with_draft_dir(config.speculative_config,
                                                                                  resolve_model))
    except FileNotFoundError as exc:
        worker_parser(kind).exit(2, f"error: {exc}\n")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(worker_class.from_args(config).run())
