"""`python -m gateway`'s flags, and the Settings they make (kept apart from gateway/__main__.py, which
sets up the process: `baton serve` builds its gateway's Settings with these same defaults)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from baton.common.env_flags import apply_env
from baton.common.logs import FORMATS
from baton.worker.args import DEFAULT_REDIS_URL, parse_bytes
from gateway.config import Settings
from gateway.parsers.reasoning import NAMES as REASONING_PARSERS
from gateway.parsers.tool_calls import NAMES as TOOL_CALL_PARSERS
from gateway.sampling_defaults import GENERATION_CONFIG_MODES


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """`python -m gateway`'s flags, each also a BATON_<FLAG> variable (of `environ`, default this
    process's environment)."""
    p = argparse.ArgumentParser(prog="python -m gateway", description="Baton HTTP gateway (TGI + OpenAI APIs)")
    p.add_argument("--model", default=None,
                   help="model directory, .gguf, or Hub repo id (default: the default model)")
    p.add_argument("--served-model-name", "--model-name", nargs="+", default=None, metavar="NAME",
                   dest="served_model_name",
                   help="one or more names requests may give as `model` (the first one is reported; "
                        "default: the model dir's basename); any other name gets 404")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) used instead of the model's")
    p.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="split a thinking model's <think> block into chat's reasoning_content (default: none)")
    p.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                   help="the format tool_choice auto reads calls in (default: the one the chat template "
                        "calls for, else hermes when it renders tools)")
    # vLLM needs this flag for tool_choice "auto"; Baton always parses tool calls, so vLLM command lines
    # that pass it work unchanged
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility; no effect: tool_choice auto is always on (the tool-call "
                        "parser comes from --tool-call-parser or the chat template)")
    p.add_argument("--generation-config", default="auto", choices=list(GENERATION_CONFIG_MODES),
                   help="auto: the model's generation_config.json sets the default temperature, top_p, top_k, "
                        "min_p and repetition_penalty of requests that leave them unset (vLLM's default); "
                        "vllm: ignore them, the APIs' own defaults apply (default auto)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                   help="Redis URL: redis[s]://, redis[s]+cluster:// or redis[s]+sentinel:// (README, 'Redis "
                        "Cluster, Sentinel and managed Redis') (default: $REDIS_URL, else redis://127.0.0.1:6379/0)")
    p.add_argument("--max-concurrent-requests", type=int, default=128,
                   help="requests in flight (running + waiting) past which the answer is 429 (default 128)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the context: longest prompt + max new tokens (default: the model's, from its config.json)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="TGI's name for --max-model-len (give one of them)")
    p.add_argument("--max-input-tokens", type=int, default=None,
                   help="longest prompt, in tokens (default: the context - 1)")
    p.add_argument("--max-batch-total-tokens", type=int, default=None,
                   help="token budget (default: KV capacity of the live decode workers)")
    p.add_argument("--max-queue-size", type=int, default=256,
                   help="requests waiting for budget past which the answer is 429 (default 256)")
    p.add_argument("--max-queue-wait", type=float, default=30.0,
                   help="seconds a request may wait for budget before a 503 (default 30)")
    p.add_argument("--api-key", default=os.environ.get("BATON_API_KEY") or None,
                   help="require `Authorization: Bearer KEY` (default: $BATON_API_KEY; none: open)")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20,
                   help="largest request body; larger gets 413 (default 32 MiB: agents send MBs of context)")
    p.add_argument("--gateway-id", default=None, help="names the token stream and heartbeat (default: random)")
    p.add_argument("--event-timeout", type=float, default=120.0,
                   help="end a request with an error after this many seconds without a token event")
    p.add_argument("--allowed-hosts", default=os.environ.get("BATON_ALLOWED_HOSTS") or None,
                   help="comma-separated Host names to answer besides loopback ones, `*` for any "
                        "(default: $BATON_ALLOWED_HOSTS; else loopback only when bound to loopback, "
                        "any otherwise)")
    p.add_argument("--max-chat-messages", type=int, default=1024,
                   help="most messages in one chat request (default 1024)")
    p.add_argument("--max-stop-token-ids", type=int, default=128,
                   help="most stop_token_ids in one request (default 128)")
    p.add_argument("--header-read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a request's headers (default 30)")
    p.add_argument("--body-read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a request's body; then 408 (default 30)")
    p.add_argument("--stream-write-timeout", type=float, default=30.0,
                   help="cancel a stream whose client reads nothing for this many seconds (default 30)")
    p.add_argument("--strict-api", action="store_true", default=_env_flag("BATON_STRICT_API"),
                   help="answer unknown request fields with a 4xx naming them (default: $BATON_STRICT_API; "
                        "else they are ignored, logged once, and listed in the x-baton-ignored-fields header)")
    p.add_argument("--responses-ttl", type=int, default=3600,
                   help="seconds a stored /v1/responses answer (store: true) is kept in Redis for "
                        "previous_response_id and GET /v1/responses/{id}; 0 stores none (default 3600)")
    p.add_argument("--responses-max-bytes", type=parse_bytes, default=parse_bytes("64MiB"), metavar="SIZE",
                   help="bytes the stored /v1/responses answers of every gateway of this Redis may take "
                        "together (e.g. 256MiB); past it the oldest are dropped, and one larger than all "
                        "of it is answered with store: false (default 64MiB)")
    p.add_argument("--pooling", default=None, choices=["last", "mean", "cls"],
                   help="how /v1/embeddings and /embed pool the prompt's hidden states (default: the "
                        "checkpoint's sentence-transformers config, else last)")
    p.add_argument("--normalize", action="store_true", help="L2-normalize embeddings (default: as the "
                   "checkpoint's sentence-transformers modules say, else normalized)")
    p.add_argument("--no-normalize", action="store_true", help="return embeddings unnormalized")
    p.add_argument("--max-embedding-tokens", type=int, default=65536,
                   help="input tokens of the embeddings requests admitted at once, in their own lane apart "
                        "from the token budget; also the most one request may have (default 65536)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default=os.environ.get("BATON_LOG_FORMAT", "text"), choices=list(FORMATS),
                   help="text lines or one JSON object per line (default: $BATON_LOG_FORMAT, else text)")
    p.add_argument("--shutdown-grace", type=float, default=float(os.environ.get("BATON_SHUTDOWN_GRACE", 40.0)),
                   help="on SIGTERM, seconds requests in flight (streams included) get to finish before "
                        "they are cut (default: $BATON_SHUTDOWN_GRACE, else 40: longer than the workers' "
                        "30 s drain, so a request a draining worker finishes is delivered)")
    apply_env(p, environ)  # every flag as BATON_<FLAG> too
    return p


def settings_from_args(args: argparse.Namespace, model_dir: Path | None = None) -> Settings:
    """The Settings of parsed flags: the model resolved (unless `model_dir` is the resolved one
    already: `baton serve`'s), the chat template read."""
    from baton.common.model_files import model_display_name, resolve_model
    from gateway.chat_template import load_chat_template

    model_dir = resolve_model(args.model) if model_dir is None else model_dir
    chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    # --gateway-id, else Settings' own: a new random one
    identity = {"gateway_id": args.gateway_id} if args.gateway_id else {}
    return Settings(
        model_dir=model_dir, chat_template=chat_template,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        generation_config=args.generation_config,
        # A Hub model is served as its repo id by default (its directory is a commit hash).
        served_model_names=tuple(args.served_model_name or [model_display_name(args.model, model_dir)]),
        host=args.host, port=args.port,
        redis_url=args.redis_url, max_concurrent_requests=args.max_concurrent_requests,
        max_model_len=args.max_model_len, max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens,
        max_batch_total_tokens=args.max_batch_total_tokens, max_queue_size=args.max_queue_size,
        max_queue_wait=args.max_queue_wait, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        event_timeout=args.event_timeout, log_level=args.log_level,
        allowed_hosts=_host_list(args.allowed_hosts), max_chat_messages=args.max_chat_messages,
        max_stop_token_ids=args.max_stop_token_ids, header_read_timeout=args.header_read_timeout,
        body_read_timeout=args.body_read_timeout, stream_write_timeout=args.stream_write_timeout,
        strict_api=args.strict_api, log_format=args.log_format, shutdown_grace=args.shutdown_grace,
        responses_ttl=args.responses_ttl, responses_max_bytes=args.responses_max_bytes,
        pooling=args.pooling, normalize=_normalize_flag(args.normalize, args.no_normalize),
        max_embedding_tokens=args.max_embedding_tokens, **identity,
    )


def _normalize_flag(normalize: bool, no_normalize: bool) -> bool | None:
    # two store_true flags, not BooleanOptionalAction: BATON_NORMALIZE / BATON_NO_NORMALIZE work too
    if normalize and no_normalize:
        raise ValueError("--normalize and --no-normalize contradict each other")
    return True if normalize else False if no_normalize else None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _host_list(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(name.strip() for name in value.split(",") if name.strip())


