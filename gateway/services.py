"""The long-lived parts of one gateway, created in the app's lifespan and shared by the handlers.

The workers are reached only through `backend` (gateway.backend): the Redis client here serves
the health probe and the dashboard, never a request's messages. Cancels are batched per loop turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from baton.common.protocol import Cancel
from gateway.admission import Admission
from gateway.backend import Backend, BackendUnavailable
from gateway.cluster import Cluster
from gateway.config import Settings
from gateway.metrics import GatewayMetrics
from gateway.router import TokenRouter
from gateway.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass
class Services:
    settings: Settings
    redis: aioredis.Redis
    tokenizer: PromptTokenizer
    metrics: GatewayMetrics
    admission: Admission
    router: TokenRouter
    cluster: Cluster
    backend: Backend  # where prefills and cancels go (Redis, or in memory for tests)
    # Fire-and-forget work (cancel messages) that must outlive the request that started it.
    # asyncio keeps only weak references to tasks, so we hold them until they finish.
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    # The long-running tasks (admission, token reader, cluster); /health checks they are alive.
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Cancels not yet written: a response that ends 1024 choices at once (64 prompts x n=16) sends
    # them in one pipeline, not 1024 concurrent XADDs (which exhausted the connection pool, and a
    # pool error reads as "Redis is down": every other request then got a 503).
    _pending_cancels: list[Cancel] = field(default_factory=list)

    def cancel(self, message: Cancel) -> None:
        """Tell every worker to drop a request (written with the others of this loop turn)."""
        self._pending_cancels.append(message)
        if len(self._pending_cancels) == 1:
            self.spawn(self._flush_cancels())

    async def _flush_cancels(self) -> None:
        await asyncio.sleep(0)  # let the rest of this turn's cancels join
        batch, self._pending_cancels = self._pending_cancels, []
        try:
            await self.backend.send_cancels(batch)
        except BackendUnavailable as exc:
            self.cluster.mark_down(exc.cause)
            log.warning("could not send %d cancel(s) (%s): %s", len(batch),
                        ", ".join(m.request_id for m in batch[:3]), exc.cause)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())
