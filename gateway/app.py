"""`create_app(settings)`: the Starlette app and the lifespan that owns the background tasks.

The lifespan runs a runtime: what builds the app's `Services` and owns their tasks.
`redis_runtime` (what serves): connect to Redis (without failing if it is down: the gateway must
come up and say so on /health), start the admission task, the token-stream reader and the
heartbeat/cluster task; on shutdown cancel them, remove our heartbeat and close the connections.
`in_memory_runtime` (tests): the same routes, middleware, admission and router, with the workers
behind a gateway.backend.InMemoryBackend; no Redis call is ever made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from baton.common import heartbeats
from baton.common.redis_client import REDIS_FAILURES, connect as connect_redis
from baton.common.urls import redact_url
from gateway import dashboard, routes_misc, sampling_defaults
from gateway.admission import Admission
from gateway.anthropic import routes as anthropic_routes
from gateway.auth import ApiKeyMiddleware
from gateway.backend import InMemoryBackend, RedisBackend
from gateway.cluster import Cluster
from gateway.config import Settings
from gateway.embeddings import pooling_config, routes as embeddings_routes
from gateway.errors import ApiError, handle_api_error, handle_http_exception, handle_unexpected
from gateway.hosts import HostCheckMiddleware, allowed_names
from gateway.http_metrics import HttpMetricsMiddleware
from gateway.metrics import GatewayMetrics
from gateway.openai import routes as openai_routes
from gateway.request_ids import RequestIdMiddleware
from gateway.request_scope import ReleaseOnExitMiddleware
from gateway.responses import routes as responses_routes
from gateway.responses.store import ResponseStore
from gateway.router import TokenRouter
from gateway.services import Services
from gateway.tgi import routes as tgi_routes
from gateway.tokenize import routes as tokenize_routes
from gateway.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)


def redis_client(url: str, socket_timeout: float | None, max_connections: int = 1024) -> aioredis.Redis:
    # Fail fast instead of redis-py's default exponential retries (seconds per command): a dead
    # Redis must turn into a 503 at once. One immediate retry still heals a pooled connection that
    # went stale when Redis restarted. The URL may name a Redis Cluster or a Sentinel's master.
    # (A refused connection fails at once; 3 s is for connecting itself: under CPU load, a
    # container's lookup of the name "redis" alone took more than a second.)
    return connect_redis(url, socket_connect_timeout=3.0, socket_timeout=socket_timeout,
                         retry=Retry(NoBackoff(), 1), health_check_interval=0,
                         # redis-py's default pool (100) fails a command at once when full, which
                         # reads as "Redis is down" (every request a 503): room for every request
                         # in flight sending at once, and then some.
                         max_connections=max_connections)


# Builds the app's services (app.state.services) for the app's life, and owns their tasks.
Runtime = Callable[[Starlette, Settings, PromptTokenizer], AbstractAsyncContextManager[None]]


def create_app(settings: Settings, tokenizer: PromptTokenizer | None = None,
               runtime: Runtime | None = None) -> Starlette:
    settings.validate()
    sampling_defaults.announce(settings)  # a generation_config.json no request could follow stops us here
    tokenizer = tokenizer or PromptTokenizer(settings.model_dir, settings.chat_template)
    _warn_if_embeddings_cannot_pool(settings)
    run = runtime or redis_runtime

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with run(app, settings, tokenizer):
            yield

    app = Starlette(
        routes=[*tgi_routes.routes, *openai_routes.routes, *tokenize_routes.routes, *routes_misc.routes,
                *anthropic_routes.routes, *responses_routes.routes, *embeddings_routes.routes, *dashboard.routes],
        middleware=[Middleware(RequestIdMiddleware),  # first: even a refused Host gets its id back
                    Middleware(HttpMetricsMiddleware),  # counts the refused ones too, by route
                    Middleware(HostCheckMiddleware, allowed=allowed_names(settings)),
                    Middleware(ApiKeyMiddleware, api_key=settings.api_key),
                    # innermost: wraps every route, so whatever way a request ends it releases
                    # its budget and cancels its workers (gateway.request_scope)
                    Middleware(ReleaseOnExitMiddleware)],
        exception_handlers={ApiError: handle_api_error, HTTPException: handle_http_exception,
                            Exception: handle_unexpected},
        lifespan=lifespan,
    )
    return app


@contextlib.asynccontextmanager
async def redis_runtime(app: Starlette, settings: Settings, tokenizer: PromptTokenizer) -> AsyncIterator[None]:
    client = redis_client(settings.redis_url, socket_timeout=5.0,
                          max_connections=max(1024, 2 * settings.max_concurrent_requests + 64))
    # The reader blocks in XREAD for a second at a time: its own connection, longer timeout.
    reader_client = redis_client(settings.redis_url, socket_timeout=10.0)
    metrics = GatewayMetrics(settings.model_name)
    admission = Admission(settings, metrics)
    router = TokenRouter(reader_client, settings.gateway_id)

    def gateway_stats() -> dict[str, object]:
        snap = admission.snapshot()
        return {"num_requests_running": snap["requests"]["running"],
                "num_requests_waiting": snap["requests"]["waiting"],
                "token_budget_in_use": snap["token_budget"]["in_use"]}

    cluster = Cluster(client, settings, admission, gateway_stats, router)
    svc = Services(settings=settings, redis=client, tokenizer=tokenizer, metrics=metrics,
                   admission=admission, router=router, cluster=cluster, backend=RedisBackend(client))
    app.state.services = svc
    monitor = dashboard.Monitor(settings, metrics, admission, cluster, client)
    app.state.monitor = monitor
    try:
        await router.reset_stream()
        await cluster.tick()
        cluster.redis_ok, cluster.redis_error = True, None
    except REDIS_FAILURES as exc:
        cluster.mark_down(exc)
        log.warning("redis at %s unreachable at startup (%s); serving 503 until it is back",
                    redact_url(settings.redis_url), exc)
    tasks = [asyncio.create_task(admission.run(), name="admission"),
             asyncio.create_task(router.run(), name="token-reader"),
             asyncio.create_task(cluster.run(), name="cluster"),
             asyncio.create_task(monitor.run(), name="monitor")]
    responses = ResponseStore(client, settings.responses_ttl, settings.responses_max_bytes, settings.retry_after_s)
    if responses.enabled:  # expired stored responses leave Redis even when none is saved
        tasks.append(asyncio.create_task(responses.sweep_forever(), name="response-sweeper"))
    for task in tasks:
        task.add_done_callback(_crash_logger)
    svc.tasks = tasks
    log.info("gateway %s serving %s (redis %s); context %d tokens (%s), prompts up to %d", settings.gateway_id,
             settings.model_name, redact_url(settings.redis_url), settings.max_total_tokens,
             "the model's" if settings.max_total_tokens == settings.model_context else
             ("--max-model-len" if settings.model_context else "the model declares none"), settings.max_input_tokens)
    try:
        yield
    finally:
        router.stop()
        cluster.stop()
        monitor.stop()
        for task in tasks:
            task.cancel()
        # Bounded: shutdown must never hang on a task that missed its cancellation.
        await asyncio.wait([*tasks, *svc.background], timeout=5.0)
        with contextlib.suppress(*REDIS_FAILURES):
            pipe = client.pipeline(transaction=False)
            heartbeats.queue_withdraw(pipe, "gateway", settings.gateway_id)
            await pipe.execute()
        await client.aclose()
        await reader_client.aclose()


def in_memory_runtime(backend: InMemoryBackend) -> Runtime:
    """Services whose workers are `backend` (tests: the HTTP layer without Redis). The Redis client
    they hold is never used by a generation request (only /health and the dashboard read it)."""

    @contextlib.asynccontextmanager
    async def run(app: Starlette, settings: Settings, tokenizer: PromptTokenizer) -> AsyncIterator[None]:
        client = redis_client(settings.redis_url, socket_timeout=1.0)  # connects lazily: never, here
        metrics = GatewayMetrics(settings.model_name)
        admission = Admission(settings, metrics)
        router = TokenRouter(client, settings.gateway_id)
        backend.attach(router)
        cluster = Cluster(client, settings, admission, dict, router)
        cluster.redis_ok, cluster.redis_error = True, None  # the backend is always reachable
        svc = Services(settings=settings, redis=client, tokenizer=tokenizer, metrics=metrics,
                       admission=admission, router=router, cluster=cluster, backend=backend)
        app.state.services = svc
        svc.tasks = [asyncio.create_task(admission.run(), name="admission")]
        try:
            yield
        finally:
            for task in svc.tasks:
                task.cancel()
            await asyncio.wait([*svc.tasks, *svc.background], timeout=5.0)
            await client.aclose()

    return run


def _warn_if_embeddings_cannot_pool(settings: Settings) -> None:
    """Said once at start-up, not only to each embedding request (which answers 501 with the same
    words): generation is unaffected, so it is no reason to refuse to start."""
    try:
        pooling_config.resolve(settings.model_dir, settings.pooling, settings.normalize)
    except ValueError as exc:
        log.warning("embeddings are off: %s", exc)


def _crash_logger(task: asyncio.Task[None]) -> None:
    """A background task must never die silently: the gateway would hang every request."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("background task %s crashed: %r", task.get_name(), task.exception())
