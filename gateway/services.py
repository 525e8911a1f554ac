"""The long-lived parts of one gateway, created in the app's lifespan and shared by the handlers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from gateway.admission import Admission
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
    # Fire-and-forget work (cancel messages) that must outlive the request that started it.
    # asyncio keeps only weak references to tasks, so we hold them until they finish.
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    # The long-running tasks (admission, token reader, cluster); /health checks they are alive.
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())
