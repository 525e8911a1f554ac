"""The config object of each child `baton serve` starts, built from its flags: a prefill or decode
worker's `WorkerConfig`, the gateway's `Settings` (docs/design-decisions.md, 26). Each starts from the
child's own defaults, read from its parser as if it were started bare (its `BATON_*` variables
apply), then takes what serve decides for it and the flags given to serve; the flag tables below say
which of serve's flags are whose."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baton.cli.supervisor import PER_PROCESS_ENV
from baton.worker.args import parse_bytes, speculative_config_arg, worker_parser
from baton.worker.config import WorkerConfig
from baton.worker.thread_lending import path_of as core_share_path

if TYPE_CHECKING:
    from gateway.config import Settings

# Flags that set the child's setting of the same name when given: (flag, type, help).
GATEWAY_FLAGS: list[tuple[str, Any, str]] = [
    ("--max-concurrent-requests", int, "past this many requests in flight the gateway answers 429"),
    ("--max-model-len", int, "the context: longest prompt + max_tokens (default: the model's, from its config.json)"),
    ("--max-input-tokens", int, "longest prompt accepted, in tokens (default: the context - 1)"),
    ("--max-total-tokens", int, "TGI's name for --max-model-len"),
    ("--max-batch-total-tokens", int, "cluster token budget: admitted requests' input + max_new_tokens"),
    ("--max-queue-size", int, "requests waiting for budget before 429"),
    ("--max-queue-wait", float, "seconds a request may wait for budget before a 503"),
    ("--shutdown-grace", float, "seconds requests in flight get to finish when the gateway stops (default 40)"),
    ("--reasoning-parser", str, "deepseek_r1 | qwen3: split a thinking model's <think> block into reasoning_content"),
    ("--tool-call-parser", str, "hermes | llama3_json | mistral | pythonic (default: from the chat template)"),
    ("--generation-config", str, "auto: the model's generation_config.json sets the sampling defaults of "
                                 "requests that leave them unset (temperature, top_p, top_k, min_p, "
                                 "repetition_penalty); vllm: ignore them (default auto)"),
    ("--responses-ttl", int, "seconds stored /v1/responses answers are kept (0: none; default 3600)"),
    ("--responses-max-bytes", parse_bytes, "bytes all stored /v1/responses answers may take, e.g. 256MiB "
                                           "(the oldest are dropped past it; default 64MiB)"),
    ("--pooling", str, "embeddings: last, mean or cls (default: the checkpoint's sentence-transformers config, else last)"),
    ("--max-embedding-tokens", int, "embeddings: input tokens admitted at once, in their own lane beside the "
                                    "generation budget (default 65536; also the largest request)"),
]
PREFILL_FLAGS: list[tuple[str, Any, str]] = [
    ("--max-num-batched-tokens", int, "prefill worker: token budget per iteration (chunked prefill)"),
    ("--pooling-step-tokens", int, "prefill worker: embeddings input tokens per step beside chat prompts "
                                   "(default: --max-num-batched-tokens / 8)"),
]
DECODE_FLAGS: list[tuple[str, Any, str]] = [
    ("--num-kv-blocks", int, "decode worker: KV blocks in its pool"),
    ("--kv-cache-memory", str, "decode worker: KV pool size instead of --num-kv-blocks, e.g. 1GiB"),
    ("--max-num-seqs", int, "decode worker: most requests in one batch"),
    ("--scheduler-policy", str, "decode worker: no-evict | max-utilization"),
    ("--speculative-config", speculative_config_arg, "decode worker: speculative decoding, JSON in vLLM's "
                                                     'shape, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\''),
]
# vLLM's names for flags above, accepted as they are
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"--kv-cache-memory": ("--kv-cache-memory-bytes",)}
WORKER_FLAGS: list[tuple[str, Any, str]] = [
    ("--block-size", int, "tokens per KV block (prefill and decode must agree)"),
]


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _children_environ() -> dict[str, str]:
    """The environment whose BATON_* variables a child's defaults take: this process's, but for one
    process's identity or port (the supervisor keeps them from the children, too)."""
    return {name: value for name, value in os.environ.items() if name not in PER_PROCESS_ENV}


def _given(args: argparse.Namespace, flags: list[tuple[str, Any, str]]) -> dict[str, Any]:
    """The values of `flags` given to `baton serve` (None: not given, the child's own default stays)."""
    values = {_dest(flag): getattr(args, _dest(flag)) for flag, _parse, _help in flags}
    return {dest: value for dest, value in values.items() if value is not None}


def _worker_config(kind: str, args: argparse.Namespace, model_dir: Path, redis_url: str, threads: int,
                   metrics_port: int | None, core_share_fd: int | None, slot: int, **own: Any) -> WorkerConfig:
    """A worker's own defaults (its parser's, $BATON_* included, as if started bare) with what
    `baton serve` decides for every worker of this machine, then `own`: its kind's settings."""
    defaults = WorkerConfig.from_args(worker_parser(kind, _children_environ()).parse_args([]))
    serve = {"model": str(model_dir), "redis_url": redis_url, "threads": threads, "dtype": args.dtype,
             "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
             **_given(args, WORKER_FLAGS)}
    if args.log_format is not None:
        serve["log_format"] = args.log_format
    if metrics_port is not None:
        serve["metrics_port"] = metrics_port
    if core_share_fd is not None:
        serve.update(core_share=core_share_path(core_share_fd), core_share_slot=slot)
    return dataclasses.replace(defaults, **serve, **own)


def prefill_worker_config(args: argparse.Namespace, model_dir: Path, redis_url: str, threads: int,
                          metrics_port: int | None, core_share_fd: int | None, slot: int) -> WorkerConfig:
    """Prefill worker `slot`'s config. Its KV pool is --prefill-kv-cache-memory (--kv-cache-memory is
    the decode workers')."""
    own = _given(args, PREFILL_FLAGS)
    if args.prefill_kv_cache_memory is not None:
        own["kv_cache_memory"] = parse_bytes(args.prefill_kv_cache_memory)
    return _worker_config("prefill", args, model_dir, redis_url, threads, metrics_port, core_share_fd, slot, **own)


def decode_worker_config(args: argparse.Namespace, model_dir: Path, redis_url: str, threads: int,
                         metrics_port: int | None, core_share_fd: int | None, slot: int) -> WorkerConfig:
    """Decode worker `slot`'s config."""
    own = _given(args, DECODE_FLAGS)
    if "kv_cache_memory" in own:
        own["kv_cache_memory"] = parse_bytes(own["kv_cache_memory"])
    return _worker_config("decode", args, model_dir, redis_url, threads, metrics_port, core_share_fd, slot, **own)


def gateway_settings(args: argparse.Namespace, model_dir: Path, redis_url: str) -> Settings:
    """The gateway's Settings: its own defaults (its parser's, $BATON_* included, as if started bare)
    with the flags given to `baton serve`, made as its own flags make them (gateway.flags)."""
    from gateway.flags import build_parser, settings_from_args

    flags = build_parser(_children_environ()).parse_args([])
    vars(flags).update(model=str(model_dir), host=args.host, port=args.port, redis_url=redis_url,
                       api_key=args.api_key, **_given(args, GATEWAY_FLAGS))
    if args.served_model_name:
        flags.served_model_name = args.served_model_name
    if args.chat_template is not None:
        flags.chat_template = args.chat_template
    if args.log_format is not None:
        flags.log_format = args.log_format
    # switches: on when given here, else as the gateway's own default ($BATON_STRICT_API ...)
    for dest in ("strict_api", "normalize", "no_normalize"):
        if getattr(args, dest):
            setattr(flags, dest, True)
    return settings_from_args(flags, model_dir)
