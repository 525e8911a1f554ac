"""Operational endpoints: /health, /ready, /info, /stats, /metrics, /v1/models, /version, /openapi.json.

/health is health (the gateway serves, its tasks run, Redis answers); /ready is readiness: also
at least one live prefill and one live, not draining, decode worker, so a load balancer or
Kubernetes sends traffic only to a gateway that can serve it (requests to a gateway without
workers would wait in the queue and end in 503). /live is the liveness probe's: only what a restart
would fix (the process answers, its tasks run), so a Redis outage does not restart every gateway.

(The live dashboard, /dashboard and /dashboard/data, lives in gateway/dashboard.py.)
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import math
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from baton.common.redis_client import REDIS_FAILURES
from baton.common.urls import redact_url
from gateway import sampling_defaults
from gateway.openapi import openapi_spec
from gateway.respond import services
from gateway.services import Services

VERSION = "0.1.0"  # when Baton runs from a source tree that was never installed


@functools.lru_cache(maxsize=1)
def baton_version() -> str:
    """The installed baton package's version (what /version and /info report)."""
    try:
        return importlib.metadata.version("baton")
    except importlib.metadata.PackageNotFoundError:
        return VERSION


def _dead_tasks(svc: Services) -> JSONResponse | None:
    """The 503 answer when a background task stopped (a bug: say so rather than hang requests)."""
    dead = [t.get_name() for t in svc.tasks if t.done()]
    if not dead:
        return None
    return JSONResponse({"status": "unhealthy", "error": f"internal task(s) stopped: {', '.join(dead)}",
                         "error_type": "generation"}, status_code=503)


async def live(request: Request) -> Response:
    """200 while the process serves and its background tasks run (what a restart would fix)."""
    return _dead_tasks(services(request)) or JSONResponse({"status": "ok"})


async def _unhealthy(svc: Services) -> JSONResponse | None:
    """The 503 answer when a task died or Redis does not answer a PING within a second, else None."""
    dead = _dead_tasks(svc)
    if dead is not None:
        return dead
    try:
        await asyncio.wait_for(svc.redis.ping(), timeout=1.0)
    except (*REDIS_FAILURES, asyncio.TimeoutError) as exc:
        svc.cluster.mark_down(exc)
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return JSONResponse({"status": "unhealthy", "redis": "unreachable",
                             "error": f"redis at {redact_url(svc.settings.redis_url)} is unreachable ({reason})",
                             "error_type": "unavailable"}, status_code=503)
    return None


async def health(request: Request) -> Response:
    """200 when Redis answers a PING (within a second), else 503 saying why."""
    svc = services(request)
    failed = await _unhealthy(svc)
    if failed is not None:
        return failed
    workers = svc.cluster.workers
    return JSONResponse({
        "status": "ok",
        "redis": "ok",
        "token_reader": "ok" if svc.router.connected else "reconnecting",
        "prefill_workers": len(workers.get("prefill", [])),
        "decode_workers": len(workers.get("decode", [])),
    })


async def ready(request: Request) -> Response:
    """200 when /health would be and the cluster view holds a live prefill worker and a live decode
    worker that is not draining; else 503 naming what is missing."""
    svc = services(request)
    failed = await _unhealthy(svc)
    if failed is not None:
        return failed
    workers = svc.cluster.workers
    prefill = len(workers.get("prefill", []))
    decode = sum(1 for w in workers.get("decode", []) if not w.get("draining"))
    missing = [f"a live {kind} worker" for kind, n in (("prefill", prefill), ("decode", decode)) if n == 0]
    body = {"status": "ready" if not missing else "not ready", "redis": "ok",
            "prefill_workers": prefill, "decode_workers": decode}
    if missing:
        return JSONResponse({**body, "missing": missing, "error": f"no {' and no '.join(m[2:] for m in missing)}",
                             "error_type": "unavailable"}, status_code=503)
    return JSONResponse(body)


async def info(request: Request) -> Response:
    """TGI's /info shape (clients read model_id and the limits from it), and the sampling defaults."""
    s = services(request).settings
    return JSONResponse({
        "model_id": s.model_name,
        "model_sha": None,
        "model_pipeline_tag": "text-generation",
        "model_dtype": None,
        "model_device_type": None,
        "router": "baton-gateway",
        "version": baton_version(),
        "sha": None,
        "docker_label": None,
        "gateway_id": s.gateway_id,
        "max_concurrent_requests": s.max_concurrent_requests,
        "max_best_of": 1,
        "max_stop_sequences": s.max_stop_sequences,
        "max_input_tokens": s.max_input_tokens,
        "max_input_length": s.max_input_tokens,  # older TGI name of the same limit
        "max_total_tokens": s.max_total_tokens,
        "max_batch_total_tokens": s.max_batch_total_tokens,
        "max_queue_size": s.max_queue_size,
        "max_queue_wait_s": s.max_queue_wait,
        "max_client_batch_size": 1,
        "validation_workers": 1,
        # The model's generation_config.json sampling defaults that requests leaving those fields
        # unset get ({} with --generation-config vllm, or when it sets none): gateway.sampling_defaults.
        "sampling_defaults": sampling_defaults.for_settings(s).as_dict(),
    })


async def stats(request: Request) -> Response:
    svc = services(request)
    m = svc.metrics
    return JSONResponse(_jsonable({
        "gateway_id": svc.settings.gateway_id,
        "model": svc.settings.model_name,
        "time": time.time(),
        "redis": {"ok": svc.cluster.redis_ok, "error": svc.cluster.redis_error,
                  "token_reader_connected": svc.router.connected},
        **svc.admission.snapshot(),
        "rejections": dict(m.rejections_by_reason),
        "finished": dict(m.successes_by_reason),
        "failed": dict(m.failures_by_reason),
        "streams": {name: dict(sample) for name, sample in m.streams.items()},
        "workers": svc.cluster.workers,
    }))


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    svc = services(request)
    # the decode workers' engine state too, so one scrape of the gateway shows the cluster
    return Response(svc.metrics.render(svc.cluster.workers.get("decode", [])), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> Response:
    """Every served name (--served-model-name), first the one responses report by default."""
    svc = services(request)
    s = svc.settings
    created = int(svc.cluster.started_at)
    return JSONResponse({"object": "list", "data": [{
        "id": name, "object": "model", "created": created, "owned_by": "baton", "root": str(s.model_dir),
        "parent": None, "max_model_len": s.max_total_tokens,
    } for name in s.served_model_names]})


async def version(request: Request) -> Response:
    return JSONResponse({"version": baton_version()})


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_spec(services(request).settings))


def _jsonable(value: Any) -> Any:
    """Heartbeats are whatever msgpack maps the workers wrote: make them JSON-safe."""
    if isinstance(value, dict):
        return {str(k if not isinstance(k, bytes) else k.decode("utf-8", "replace")): _jsonable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/Infinity
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


routes = [
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/live", live, methods=["GET"]),
    Route("/info", info, methods=["GET"]),
    Route("/stats", stats, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
