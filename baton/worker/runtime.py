"""What every worker process shares: Redis connection, consumer groups, heartbeats, cancels,
claiming a dead consumer's messages, signal handling."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from baton.common import heartbeats, protocol, redis_client
from baton.common.redis_client import REDIS_RETRYABLE

logger = logging.getLogger("baton.worker")

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5


def default_worker_id(kind: str) -> str:
    """kind-host-pid plus a per-boot random part: a restarted container keeps its hostname and
    often its pid (1 under an init), and must not inherit its dead predecessor's identity (whose
    pending messages are only claimed once that identity's heartbeat has expired)."""
    return f"{kind}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def connect(url: str) -> Redis:
    """A client for `url`: one Redis, a Redis Cluster or a Sentinel's master (baton/common/redis_client.py)."""
    return redis_client.connect(url, decode_responses=False, socket_timeout=10, socket_connect_timeout=5,
                                health_check_interval=10)


async def ensure_group(redis: Redis, stream: str, group: str) -> None:
    """Create the consumer group at start-up (from the stream's beginning; MKSTREAM)."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def read_group(redis: Redis, stream: str, group: str, consumer: str, count: int,
                     block_ms: int | None) -> list[tuple[bytes, dict]]:
    reply = await redis.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
    if not reply:
        return []
    return list(reply[0][1])


async def _dead_consumers(redis: Redis, kind: str, names: list[bytes]) -> list[bytes]:
    """The consumers among `names` whose heartbeat has expired."""
    if not names:
        return []
    alive = await heartbeats.live_ids(redis, kind)
    return [name for name in names if name.decode() not in alive]


async def claim_from_dead(redis: Redis, stream: str, group: str, consumer: str, kind: str,
                          min_idle_ms: int, count: int = 50) -> list[tuple[bytes, dict, int]]:
    """Claim messages taken by consumers that died (heartbeat expired) and idle >= min_idle_ms.

    Idle time alone cannot tell a dead consumer from a slow one (a decode worker holds a handoff
    unacked until the request finishes), so the owner's heartbeat decides. The scan is per dead
    consumer: a live peer's many older entries must not hide a dead one's. Returns (id, fields,
    times delivered) for each message now ours.
    """
    summary = await redis.xpending(stream, group)
    owners = [c["name"] for c in summary.get("consumers") or [] if c["name"] != consumer.encode()]
    claimed: list[tuple[bytes, dict, int]] = []
    for owner in await _dead_consumers(redis, kind, owners):
        pending = await redis.xpending_range(stream, group, min="-", max="+", count=count,
                                             consumername=owner, idle=min_idle_ms)
        if not pending:
            continue
        deliveries = {p["message_id"]: p["times_delivered"] for p in pending}
        got = await redis.xclaim(stream, group, consumer, min_idle_time=min_idle_ms, message_ids=list(deliveries))
        if got:  # (none: a live peer claimed them first)
            logger.warning("claimed %d messages of dead %s consumer %s", len(got), kind, owner.decode())
        claimed += [(mid, fields, deliveries.get(mid, 1)) for mid, fields in got if fields]
    return claimed


async def remove_dead_consumers(redis: Redis, stream: str, group: str, kind: str, min_idle_ms: int = 60_000) -> list[str]:
    """Delete consumers that hold nothing, are long idle and have no heartbeat: every boot of a
    worker is a new consumer (its id is per boot), so without this the group grows forever."""
    idle = [c["name"] for c in await redis.xinfo_consumers(stream, group)
            if c["pending"] == 0 and c["idle"] >= min_idle_ms]
    idle = [name if isinstance(name, bytes) else name.encode() for name in idle]
    removed = []
    for name in await _dead_consumers(redis, kind, idle):
        await redis.xgroup_delconsumer(stream, group, name)
        removed.append(name.decode())
    if removed:
        logger.info("removed %d dead %s consumers from %s", len(removed), kind, stream)
    return removed


def _stream_id(value: bytes | str) -> tuple[int, int]:
    ms, _, seq = (value.decode() if isinstance(value, bytes) else value).partition("-")
    return int(ms), int(seq or 0)


async def trim_acknowledged(redis: Redis, stream: str) -> int:
    """Delete the entries of a work stream that every consumer group has acknowledged; returns how
    many went. The work streams have no MAXLEN (it deleted unread work past 10k entries), so this
    is what keeps them from growing forever: what stays is what is not yet done.

    The bound, per group, is its oldest pending entry (delivered, not acked), or with none the id
    just after its last-delivered one (everything up to it was delivered and acked); entries below
    the lowest bound of all groups are acknowledged by all. The groups are read before their
    pending entries: an entry delivered in between is newer than the last-delivered id read, so it
    is kept. A stream without a group keeps everything (nothing has read it). XTRIM MINID leaves
    the groups' lag exact (XDEL would make Redis report it unknown), so `baton:stream_lag` stays
    right. Safe from any number of workers at once: a bound, once computed, stays safe (an acked
    entry is never pending again).
    """
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:  # no such stream yet
        return 0
    bound: tuple[int, int] | None = None
    for group in groups:
        info = {k.decode() if isinstance(k, bytes) else k: v for k, v in group.items()}
        last_ms, last_seq = _stream_id(info["last-delivered-id"])
        group_bound = (last_ms, last_seq + 1)
        if int(info["pending"]):
            oldest = (await redis.xpending(stream, info["name"]))["min"]
            if oldest is not None:
                group_bound = min(group_bound, _stream_id(oldest))
        bound = group_bound if bound is None else min(bound, group_bound)
    if bound is None or bound <= (0, 1):
        return 0
    return int(await redis.xtrim(stream, minid=f"{bound[0]}-{bound[1]}", approximate=False))


class CancelWatcher:
    """Reads the broadcast cancel stream; remembers recently cancelled request ids (bounded)."""

    def __init__(self, redis: Redis, capacity: int = 100_000) -> None:
        self.redis = redis
        self.cancelled: OrderedDict[str, float] = OrderedDict()
        self.capacity = capacity
        self.last_id = b"$"
        self.new_ids: list[str] = []  # cancels not yet applied by the worker's loop

    def pop_new(self) -> list[str]:
        new, self.new_ids = self.new_ids, []
        return new

    async def run(self, stopping: asyncio.Event) -> None:
        backoff = 0.1
        if self.last_id == b"$":
            try:
                # Start from the current end, but remember the position: no cancel is missed later.
                info = await self.redis.xinfo_stream(protocol.CANCEL_STREAM)
                self.last_id = info["last-generated-id"]
            except ResponseError:
                self.last_id = b"0-0"
            except REDIS_RETRYABLE:
                self.last_id = b"0-0"
        while not stopping.is_set():
            try:
                reply = await self.redis.xread({protocol.CANCEL_STREAM: self.last_id}, count=500, block=500)
                backoff = 0.1
            except REDIS_RETRYABLE as exc:
                logger.warning("cancel reader: redis unavailable (%s); retrying", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            for _, entries in reply or []:
                for message_id, fields in entries:
                    self.last_id = message_id
                    try:
                        cancel = protocol.decode(fields[protocol.PAYLOAD_FIELD], protocol.Cancel)
                    except (protocol.MalformedMessage, KeyError) as exc:
                        logger.error("ignoring malformed cancel %s: %s", message_id, exc)
                        continue
                    self.cancelled[cancel.request_id] = time.time()
                    self.new_ids.append(cancel.request_id)
                    while len(self.cancelled) > self.capacity:
                        self.cancelled.popitem(last=False)


async def heartbeat_loop(redis: Redis, kind: str, worker_id: str, state: Callable[[], dict[str, Any]],
                         stopping: asyncio.Event) -> None:
    while not stopping.is_set():
        try:
            payload = {"worker_id": worker_id, "kind": kind, "time": time.time(), **state()}
            pipe = redis.pipeline(transaction=False)
            heartbeats.queue_beat(pipe, kind, worker_id, payload, HEARTBEAT_TTL_S)
            await pipe.execute()
        except REDIS_RETRYABLE as exc:
            logger.warning("heartbeat failed (%s)", exc)
        try:
            await asyncio.wait_for(stopping.wait(), HEARTBEAT_INTERVAL_S)
        except asyncio.TimeoutError:
            pass
    try:
        pipe = redis.pipeline(transaction=False)
        heartbeats.queue_withdraw(pipe, kind, worker_id)  # a clean exit withdraws its capacity at once
        await pipe.execute()
    except REDIS_RETRYABLE:
        pass


class GatewayWatch:
    """Which gateways are gone. A gateway whose heartbeat lapsed may only be stalled (a long
    event-loop pause), and dropping its requests is final, so "gone" is an explicit decision: no
    heartbeat seen for `grace_s`, judged only while Redis answers."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.started = time.monotonic()
        self.last_seen: dict[str, float] = {}
        self.last_refresh = 0.0
        self.last_answer = 0.0  # when Redis last told us who is alive

    async def refresh(self, redis: Redis, every_s: float = 1.0) -> None:
        now = time.monotonic()
        if now - self.last_refresh < every_s:
            return
        self.last_refresh = now
        alive = await live_gateways(redis)
        if alive is None:
            return
        self.last_answer = now
        for gateway_id in alive:
            self.last_seen[gateway_id] = now

    def is_gone(self, gateway_id: str) -> bool:
        now = time.monotonic()
        if now - self.last_answer > 5.0:
            return False  # no recent answer from Redis: no verdict
        return now - self.last_seen.get(gateway_id, self.started) > self.grace_s


async def live_gateways(redis: Redis) -> set[str] | None:
    """Ids of gateways whose heartbeat is alive (None if Redis cannot tell us now)."""
    try:
        beats = await heartbeats.live(redis, "gateway")
    except REDIS_RETRYABLE:
        return None
    return {heartbeats.worker_id_of(key) for key, _ in beats}


def install_signal_handlers(stopping: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

