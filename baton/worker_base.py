"""The life cycle both worker kinds share: start-up, the loop with Redis backoff, graceful drain."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from baton import protocol
from baton.engine import EngineConfig, LLMEngine
from baton.worker_metrics import WorkerMetrics, serve_metrics
from baton.worker_runtime import (REDIS_ERRORS, CancelWatcher, connect, default_worker_id, ensure_group,
                                  heartbeat_loop, install_signal_handlers)
from kvstore.redis_backend import RedisBlockStore
from redis.exceptions import ResponseError

logger = logging.getLogger("baton.worker")


class WorkerBase:
    kind = "worker"
    stream = ""
    group = ""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker_id = args.worker_id or default_worker_id(self.kind)
        self.engine = LLMEngine(EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            scheduler_policy=getattr(args, "scheduler_policy", "max-utilization"), num_threads=args.threads,
        ))
        self.redis = connect(args.redis_url)
        self.store = RedisBlockStore(self.redis)
        self.cancels = CancelWatcher(self.redis)
        self.metrics = WorkerMetrics(self.engine.model_dir.name, self.kind)
        self.stopping = asyncio.Event()
        self.last_claim = 0.0
        self.tasks: list[asyncio.Task] = []

    def state(self) -> dict:
        raise NotImplementedError

    async def iteration(self, accept_new: bool) -> None:
        raise NotImplementedError

    def num_in_flight(self) -> int:
        raise NotImplementedError

    def background_tasks(self) -> list[Coroutine[Any, Any, None]]:
        """Coroutines that run beside the loop until exit (after `flush`)."""
        return []

    async def flush(self, timeout: float) -> None:
        """Before exit: write out whatever output is still queued."""

    async def run(self) -> None:
        install_signal_handlers(self.stopping)
        serve_metrics(self.args.metrics_port)
        await self._wait_for_redis()
        await ensure_group(self.redis, self.stream, self.group)
        self.tasks = [
            asyncio.create_task(heartbeat_loop(self.redis, self.kind, self.worker_id, self.state, self.stopping)),
            asyncio.create_task(self.cancels.run(self.stopping)),
            *(asyncio.create_task(coro) for coro in self.background_tasks()),
        ]
        logger.info("%s worker %s ready (%s)", self.kind, self.worker_id, self.engine.model_dir.name)
        backoff = 0.1
        while not self.stopping.is_set():
            try:
                await self.iteration(accept_new=True)
                backoff = 0.1
            except REDIS_ERRORS as exc:
                logger.warning("redis unavailable (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # Redis came back empty (restarted without persistence): recreate our group.
                logger.warning("consumer group missing (%s); recreating it", exc)
                await ensure_group(self.redis, self.stream, self.group)
        await self.drain()

    async def drain(self) -> None:
        """SIGTERM: take nothing new, finish what is in flight within the drain time, then exit.
        Whatever is left stays unacked in its stream, for a live worker of the same kind to claim."""
        deadline = time.monotonic() + self.args.drain_timeout
        logger.info("draining %d requests (at most %.0fs)", self.num_in_flight(), self.args.drain_timeout)
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            try:
                await self.iteration(accept_new=False)
            except REDIS_ERRORS:
                await asyncio.sleep(0.2)
        await self.flush(timeout=max(1.0, deadline - time.monotonic()))
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.redis.aclose()
        logger.info("%s worker %s stopped", self.kind, self.worker_id)

    async def _wait_for_redis(self) -> None:
        backoff = 0.1
        while not self.stopping.is_set():
            try:
                await self.redis.ping()
                return
            except REDIS_ERRORS as exc:
                logger.warning("waiting for redis (%s)", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def queue_event(self, pipe, gateway_id: str, event: protocol.TokenEvent) -> None:
        pipe.xadd(protocol.token_stream(gateway_id), {protocol.PAYLOAD_FIELD: protocol.encode(event)},
                  maxlen=protocol.STREAM_MAXLEN, approximate=True)

    async def fail_request(self, message_id: bytes, request_id: str, gateway_id: str, num_prompt_tokens: int,
                           index: int, error: str) -> None:
        """End a request with an error event (never silence) and ack its message."""
        logger.error("request %s failed: %s", request_id, error)
        event = protocol.TokenEvent(request_id, index, [], [], finish_reason="error", error=error,
                                    num_prompt_tokens=num_prompt_tokens, worker_id=self.worker_id)
        pipe = self.redis.pipeline(transaction=False)
        self.queue_event(pipe, gateway_id, event)
        pipe.xack(self.stream, self.group, message_id)
        await pipe.execute()
        self.metrics.finished("error")
