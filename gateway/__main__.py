"""`python -m gateway`: run the HTTP gateway (Starlette on uvicorn with uvloop)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# Counters' `_created` series only clutter /metrics (set before prometheus_client is imported).
os.environ.setdefault("PROMETHEUS_DISABLE_CREATED_SERIES", "True")

from baton.common.logs import setup_logging, uvicorn_log_config
from baton.common.service_config import SERVICE_CONFIG_ENV
from baton.common.tracing import setup_tracing
from baton.worker.args import DEFAULT_REDIS_URL
from gateway.config import Settings
from gateway.flags import build_parser, settings_from_args


def parse_args(argv: list[str] | None = None) -> Settings:
    """The Settings of these flags (`python -m gateway --flags`)."""
    return settings_from_args(build_parser().parse_args(argv))


def load_settings(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """The Settings `baton serve` handed over in $BATON_SERVICE_CONFIG when set (then no flags are
    taken; the secrets come from REDIS_URL and BATON_API_KEY), else those of the flags."""
    environ = os.environ if environ is None else environ
    text = environ.get(SERVICE_CONFIG_ENV)
    if text is None:
        return parse_args(argv)
    if sys.argv[1:] if argv is None else argv:
        raise ValueError(f"no flags are taken with {SERVICE_CONFIG_ENV} set: it holds the whole config")
    return Settings.from_json(text, redis_url=environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                              api_key=environ.get("BATON_API_KEY") or None)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except (FileNotFoundError, ValueError) as exc:  # --model, --chat-template: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    level = settings.log_level
    setup_logging(level, settings.log_format)
    setup_tracing("baton-gateway")  # only with an OTLP endpoint set and OpenTelemetry installed
    try:
        settings.validate()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import logging

    import uvicorn

    from gateway.app import create_app
    from gateway.hosts import exposure_warning
    from gateway.http_protocol import http_protocol

    warning = exposure_warning(settings.host, settings.port, settings.api_key)
    if warning:  # `baton serve` passes its children's stderr on: its users see this line too
        logging.getLogger("gateway").warning(warning)

    try:
        app = create_app(settings)
    except ValueError as exc:  # e.g. a generation_config.json no request could follow: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=settings.host, port=settings.port, loop="uvloop", log_level=level,
                http=http_protocol(settings), timeout_keep_alive=settings.keep_alive_timeout,
                timeout_graceful_shutdown=settings.shutdown_grace,
                log_config=uvicorn_log_config(level))
    return 0


if __name__ == "__main__":
    sys.exit(main())
