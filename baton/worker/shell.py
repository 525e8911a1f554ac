"""The I/O shell both worker kinds share around their core: start-up, the loop with Redis backoff,
the opening of stream messages, the KV loads the scheduler asks for, writing effects, graceful drain.

The shell never touches the scheduler, the block pool or the model runner: it talks to the engine
(add, abort, step, KV loads, stats) and to its core (messages in, effects out). It is given its
engine, Redis client and block store (`from_args` builds the real ones; tests pass their own), and
nothing touches the engine while a step runs in its thread: the loop and the heartbeat read
`self.stats`, the snapshot taken after the last step, admission or cancel.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from prometheus_client import REGISTRY, CollectorRegistry
from redis.exceptions import ResponseError

from baton.engine.kv_types import KVLoad, LoadedKV
from baton.engine.llm_engine import EngineConfig, LLMEngine
from baton.engine.outputs import EngineOutput, EngineStats
from baton.common.logs import request_extra
from baton.common.model_files import weight_files
from baton.worker.config import WorkerConfig
from baton.worker.core import Effects, Opening, WorkerCore
from baton.worker.thread_lending import StepCores, run_with_threads
from baton.worker.health import LoopWatch, serve_metrics
from baton.worker.metrics import WorkerMetrics
from baton.common.redis_client import REDIS_RETRYABLE
from baton.worker.runtime import (CancelWatcher, GatewayWatch, claim_from_dead, connect,
                                  default_worker_id, ensure_group, heartbeat_loop, install_signal_handlers, remove_dead_consumers,
                                  trim_acknowledged)
from baton.worker.kv_transfer import StoreKVTransfer
from baton.worker.writer import write_effects
from kvstore.redis_backend import RedisBlockStore

logger = logging.getLogger("baton.worker")


def build_engine(args: WorkerConfig) -> LLMEngine:
    """The worker's engine, holding each weight once (`RuntimeConfig.release_load_copies`)."""
    return LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        scheduler_policy=args.scheduler_policy, num_threads=args.threads,
        kv_connector=True, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,  # decode workers only
        release_load_copies=True,
    ))


def weights_label(model_dir: Path, dtype: str, quantization: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf 98 MB' (or 'model.safetensors ...', 'N files ...'): the files
    the load reads (baton.common.model_files.weight_files)."""
    files = weight_files(model_dir, dtype, quantization)
    if not files:
        return "no weight files found"
    name = files[0].name if len(files) == 1 else f"{len(files)} files"
    return f"{name} {sum(path.stat().st_size for path in files) / 1e6:.0f} MB"


def resident_mb(status: Path = Path("/proc/self/status")) -> float | None:
    """This process's resident memory (VmRSS) in MB; None where /proc does not say (not Linux)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6  # the kernel says kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


class _Prefixed(logging.Filter):
    """Puts `prefix: ` before each message of one logger (its records keep their level and args)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix.replace("%", "%%")  # the message is a %-format string

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = f"{self.prefix}: {record.msg}"
        return True


@contextmanager
def _named_kernel_lines(name: str) -> Iterator[None]:
    """While this worker loads, its native-kernel build lines name it: prefill and decode workers
    build (or wait for each other's build) at the same time, and their lines reach one terminal."""
    kernel_logger = logging.getLogger("baton.model.kernels")
    prefixed = _Prefixed(name)
    kernel_logger.addFilter(prefixed)
    try:
        yield
    finally:
        kernel_logger.removeFilter(prefixed)


def load_engine(args: WorkerConfig, name: str) -> LLMEngine:
    """`build_engine`, with a line when the load starts and one when it is done (elapsed seconds,
    the KV pool, the process's resident memory): a load takes minutes on a first start (the native
    kernels are compiled) or with a large model, and `baton serve` shows these lines as it waits."""
    model_dir = Path(args.model or "")
    logger.info("%s: loading %s (%s, dtype %s, quantization %s) ...", name, model_dir.name,
                weights_label(model_dir, args.dtype, args.quantization), args.dtype, args.quantization)
    started = time.monotonic()
    with _named_kernel_lines(name):
        engine = build_engine(args)
    rss = resident_mb()
    logger.info("%s: loaded in %.1fs (%s%s; KV pool %.0f MiB%s)", name, time.monotonic() - started,
                str(engine.dtype).removeprefix("torch."),
                "" if engine.quantization == "none" else f", {engine.quantization} weights",
                engine.kv_cache_bytes / 2**20, "" if rss is None else f"; resident memory {rss:.0f} MB")
    return engine


class WorkerShell:
    kind = "worker"
    stream = ""
    group = ""
    core_class: type[WorkerCore] = WorkerCore
    overlap_warned_at = 0.0  # monotonic: the last warning of a failed read during a step

    def __init__(self, args: WorkerConfig, engine: LLMEngine, redis: Any, store: RedisBlockStore | None = None,
                 registry: CollectorRegistry = REGISTRY) -> None:
        """`store`: the block store (default: Redis' over `redis`); `registry`: a private one lets
        several workers live in one process (tests)."""
        self.args = args
        self.registry = registry
        # /health on the metrics port: the loop below stamps it every turn.
        self.watch = LoopWatch(args.stall_timeout)
        self.metrics_server: Any = None
        self.engine = engine
        self.stats: EngineStats = engine.stats()
        self.in_step = False  # a step is running in its thread (the heartbeat says so)
        self.worker_id = args.worker_id or default_worker_id(self.kind)
        self.metrics = WorkerMetrics(self.engine.model_dir.name, self.kind, registry)
        self.core = self.core_class(self.engine, self.worker_id, self.metrics)
        self.redis = redis
        self.store = store if store is not None else RedisBlockStore(redis)
        runtime = engine.runtime
        self.kv = StoreKVTransfer(self.store, engine.block_shape,
                                  runtime.state_kind if runtime.has_state_layers else None, runtime.state_layout())
        self.cancels = CancelWatcher(self.redis)
        self.gateways = GatewayWatch(args.gateway_grace)
        self.stopping = asyncio.Event()  # SIGTERM: take nothing new, drain
        self.exiting = asyncio.Event()  # the drain is over: heartbeat and cancel reader stop now
        self.last_claim = 0.0
        self.last_consumer_cleanup = time.monotonic()
        self.tasks: list[asyncio.Task] = []
        self.loads: list[asyncio.Task[LoadedKV]] = []  # KV loads in flight, in the order scheduled
        self.num_blocks_fetched = 0
        self.num_preemptions_seen = 0
        self.drain_deadline: float | None = None  # monotonic; set when a drain starts
        # cores lent by an idle prefill worker to a decode worker (`baton serve` on one machine)
        self.cores = StepCores.from_args(self.kind, args.core_share, args.core_share_slot,
                                         args.threads or torch.get_num_threads())
        self.engine.set_thread_gate(self.cores.gate)  # lent threads given back between layers

    @classmethod
    def from_args(cls, args: WorkerConfig, registry: CollectorRegistry = REGISTRY) -> WorkerShell:
        """The worker `python -m <kind>_worker` runs: its engine, Redis client and store from its config."""
        # its id now: the load's progress lines name the worker as its later lines do
        args = dataclasses.replace(args, worker_id=args.worker_id or default_worker_id(cls.kind))
        engine = load_engine(args, f"{cls.kind} worker {args.worker_id}")
        return cls(args, engine, connect(args.redis_url), registry=registry)

    def state(self) -> dict:
        """What the heartbeat advertises (counts of this kind of worker, from `self.stats`)."""
        raise NotImplementedError

    def heartbeat(self) -> dict:
        # A draining worker is alive (its requests are not claimable) but takes nothing new: the
        # gateway leaves its capacity out of the budget, and peers out of their balancing.
        # "in_step": a step (one long prompt chunk can take minutes on a small CPU) is computing: with
        # num_tokens_computed, what tells the gateway a busy worker from a stalled one
        return {**self.state(), "draining": self.stopping.is_set(), "in_step": self.in_step}

    async def iteration(self, accept_new: bool) -> None:
        raise NotImplementedError

    def num_in_flight(self) -> int:
        raise NotImplementedError

    def has_work(self) -> bool:
        """Whether anything is left to compute (a drain runs until not): what the engine holds,
        and what a prefill worker holds back to feed it (embeddings batches)."""
        return self.engine.has_unfinished()

    def background_tasks(self) -> list[Coroutine[Any, Any, None]]:
        """Coroutines that run beside the loop until exit (after `flush`)."""
        return []

    async def flush(self, timeout: float) -> None:
        """Before exit: write out whatever output is still queued."""

    async def run(self) -> None:
        install_signal_handlers(self.stopping)
        self.metrics_server = serve_metrics(self.args.metrics_port, self.args.metrics_host, self.watch, self.registry)
        await self._wait_for_redis()
        await ensure_group(self.redis, self.stream, self.group)
        self.tasks = [
            # Both run through the drain: peers must see this worker alive (or they would claim and
            # decode its requests a second time), and cancels must still stop its requests.
            asyncio.create_task(heartbeat_loop(self.redis, self.kind, self.worker_id, self.heartbeat, self.exiting)),
            asyncio.create_task(self.cancels.run(self.exiting)),
            *(asyncio.create_task(coro) for coro in self.background_tasks()),
        ]
        logger.info("%s worker %s ready (%s)", self.kind, self.worker_id, self.engine.model_dir.name)
        backoff = 0.1
        while not self.stopping.is_set():
            self.watch.turn()
            try:
                await self.iteration(accept_new=True)
                backoff = 0.1
            except REDIS_RETRYABLE as exc:
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
        deadline = self.drain_deadline = time.monotonic() + self.args.drain_timeout
        self.watch.draining = True
        logger.info("draining %d requests (at most %.0fs)", self.num_in_flight(), self.args.drain_timeout)
        while self.has_work() and time.monotonic() < deadline:
            self.watch.turn()
            try:
                await self.iteration(accept_new=False)
            except REDIS_RETRYABLE:
                await asyncio.sleep(0.2)
        await self.flush(timeout=max(1.0, deadline - time.monotonic()))
        self.exiting.set()  # the heartbeat withdraws itself: what is left unacked is now claimable
        await asyncio.wait(self.tasks[:2], timeout=2.0)
        for task in [*self.tasks, *self.loads]:
            task.cancel()
        await asyncio.gather(*self.tasks, *self.loads, return_exceptions=True)
        self.cores.close()
        await self.redis.aclose()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        logger.info("%s worker %s stopped", self.kind, self.worker_id)

    async def _wait_for_redis(self) -> None:
        backoff = 0.1
        while not self.stopping.is_set():
            self.watch.turn()  # waiting for Redis is not being stuck
            try:
                await self.redis.ping()
                return
            except REDIS_RETRYABLE as exc:
                logger.warning("waiting for redis (%s)", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    # ---- messages ----

    async def open(self, message_id: bytes, fields: dict, deliveries: int) -> Any:
        """The shared opening: the message to admit, or None once a message that is not admitted
        (dead letter, cancelled or duplicate, past its delivery cap) has been dealt with."""
        opened = self.core.open(fields, deliveries, self.cancels.cancelled)
        if opened.outcome is Opening.ADMIT:
            return opened.message
        await self.write(self.core.opening_effects(message_id, fields, opened))
        return None

    async def claim(self) -> list[tuple[bytes, dict, int]]:
        """Messages of dead peers, claimed at most once a second, when the stream's acknowledged
        entries are trimmed too (and, twice a minute, dead consumers that hold nothing are removed
        from the group)."""
        now = time.monotonic()
        if now - self.last_consumer_cleanup > 30.0:
            self.last_consumer_cleanup = now
            await remove_dead_consumers(self.redis, self.stream, self.group, self.kind)
        if now - self.last_claim < 1.0:
            return []
        self.last_claim = now
        await trim_acknowledged(self.redis, self.stream)
        return await claim_from_dead(self.redis, self.stream, self.group, self.worker_id, self.kind,
                                     self.args.claim_idle_ms)

    async def write(self, effects: Effects, transaction: bool = False) -> None:
        """Write effects now, in their safe order: one pipeline (MULTI/EXEC if `transaction`) on one
        Redis; on a Redis Cluster, data first, then the single-slot MULTI/EXEC of the stream
        operations (baton/worker/writer.py)."""
        await write_effects(self.redis, effects, self.stream, self.group, transaction, self.store)

    async def write_until_done(self, effects: Effects, transaction: bool = False) -> bool:
        """Write effects whose state change already happened (a step's output): retried with
        backoff until Redis takes them, so an outage delays them but never loses them. Gives up
        (False) only when a drain runs out of time: the messages stay unacked, and once this
        worker's heartbeat is gone a peer claims and redoes them."""
        backoff = 0.05
        while True:
            try:
                await self.write(effects, transaction)
                return True
            except REDIS_RETRYABLE as exc:
                if self.drain_deadline is not None and time.monotonic() > self.drain_deadline:
                    logger.error("could not write a step's output before exit (%s); peers will redo it", exc)
                    return False
                logger.warning("writing a step's output failed (%s); retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    # ---- the engine step and its KV loads ----

    async def step(self, overlap: Coroutine[Any, Any, None] | None = None) -> list[EngineOutput]:
        """One engine step in a thread (the engine is not touched meanwhile), given the KV loads
        that arrived; `overlap` runs on the loop during it. Starts the KV loads the step's schedule
        asked for. A Redis failure of `overlap` is logged (at most once a second), not raised: the
        step ran all the same, and its output must reach the caller (raising dropped a step's tokens
        per failed read: a Redis Cluster failover cost every stream 3 tokens, a "token stream gap").
        The next step reads again."""
        threads = await self.cores.before_step()
        started = time.perf_counter()
        loaded = self._take_loaded()
        self.in_step = True
        step = asyncio.ensure_future(asyncio.to_thread(run_with_threads, self.engine.step, loaded, threads=threads))
        overlap_error: BaseException | None = None
        if overlap is not None:
            try:
                await overlap
            except REDIS_RETRYABLE as exc:
                overlap_error = exc
        try:
            outputs = await step
        finally:
            self.in_step = False
            self.cores.after_step(time.perf_counter() - started)
        self.metrics.step_seconds.observe(self.cores.last_step_seconds)
        self.metrics.step_threads.set(threads if threads is not None else self.cores.threads)
        if self.cores.last_step_borrowed:
            self.metrics.borrowed_steps.inc()
        self.metrics.core_reclaim_seconds.set(self.cores.reclaim_seconds)
        for load in self.engine.take_kv_loads():
            self.loads.append(asyncio.create_task(self._fetch(load)))
        self.refresh_stats()
        self.metrics.iteration_tokens.observe(max(1, self.stats.num_batched_tokens))
        if overlap_error is not None and time.monotonic() - self.overlap_warned_at >= 1.0:
            self.overlap_warned_at = time.monotonic()
            logger.warning("redis unavailable during a step (%s); its output is kept, reading again", overlap_error)
        return outputs

    async def _fetch(self, load: KVLoad) -> LoadedKV:
        try:
            return await self.kv.load(load)
        except REDIS_RETRYABLE as exc:  # not fatal: the request computes what it could not load
            logger.warning("loading the KV of %s failed (%s); computing it here", load.request_id, exc,
                           extra=request_extra(load.request_id))
            return LoadedKV(load.request_id)

    async def wait_for_loads(self) -> None:
        """When nothing but KV loads is left to run, wait for one: a step now would compute nothing."""
        if self.loads and not self.engine.has_runnable() and not any(task.done() for task in self.loads):
            await asyncio.wait(self.loads, return_when=asyncio.FIRST_COMPLETED)

    def _take_loaded(self) -> list[LoadedKV]:
        """The finished KV loads, for the next step (counted in the metrics here)."""
        done = [task for task in self.loads if task.done()]
        if not done:
            return []
        self.loads = [task for task in self.loads if not task.done()]
        results = [task.result() for task in done]
        for result in results:
            self.num_blocks_fetched += len(result.block_hashes)
            self.metrics.blocks_fetched.inc(len(result.block_hashes))
            self.metrics.bytes("fetched", result.num_bytes)
            self.metrics.blocks_missing.inc(result.num_missing)
            self.metrics.blocks_rejected.inc(result.num_rejected)
            if result.num_missing:
                logger.info("request %s: %d of its blocks are no longer in the store; computing them here",
                            result.request_id, result.num_missing, extra=request_extra(result.request_id))
        return results

    def refresh_stats(self) -> None:
        """Take the engine's snapshot (between steps only) and update the gauges from it."""
        stats = self.stats = self.engine.stats()
        self.metrics.num_requests_running.set(stats.num_requests_running + stats.num_requests_loading_kv)
        self.metrics.num_requests_waiting.set(stats.num_requests_waiting)
        self.metrics.kv_cache_usage_perc.set(stats.kv_cache_usage)
        new = stats.num_preemptions - self.num_preemptions_seen
        if new:
            self.metrics.num_preemptions.inc(new)
            self.num_preemptions_seen = stats.num_preemptions
