"""Writing a worker's `Effects` to Redis in their safe order (docs/design-decisions.md §5): the one
place that turns effects into Redis commands (blocks through the block store, which owns its keys).

On one Redis, one pipeline carries them all (MULTI/EXEC when the caller asks): Redis runs a
pipeline's commands in order. On a Redis Cluster a pipeline is split by node and the nodes run
their parts concurrently, so order between slots holds only between round trips: the data (blocks,
partial block, token events) is written and acknowledged first, then the stream operations
(handoffs, dead letters, acks: one slot, one MULTI/EXEC), then the deletes. Each step may be
retried whole, so a failure or a crash between them is safe.

`redis` is redis-py's asyncio client (one server or a cluster) or kvstore.memory_backend's
in-memory stand-in (the worker-core tests).
"""

from __future__ import annotations

from typing import Any

from baton.common import protocol
from baton.worker.core import Effects
from kvstore.redis_backend import RedisBlockStore, is_cluster


def queue_data(pipe: Any, effects: Effects, store: RedisBlockStore) -> None:
    """What may be written twice: blocks (SET NX, same content), TTL refreshes, the partial block
    (same content), token events (the gateway drops the indices it already has). Any slots."""
    store.queue_writes(pipe, effects.block_puts, effects.block_refreshes, effects.partial_puts)
    for gateway_id, events in effects.events.items():
        pipe.xadd(protocol.token_stream(gateway_id), {protocol.PAYLOAD_FIELD: protocol.encode_token_batch(events)},
                  maxlen=protocol.STREAM_MAXLEN, approximate=True, nomkstream=True)


def queue_stream_ops(pipe: Any, effects: Effects, stream: str, group: str) -> None:
    """What must happen once, together: dead letters, handoffs and the acks of the messages they
    came from. All on the pipeline streams' hash tag, so one MULTI/EXEC even on a Redis Cluster."""
    for message_id, fields, error in effects.dead_letters:
        # a bounded tail: undecodable messages parked for an operator, not work anyone will do
        pipe.xadd(protocol.DEAD_LETTER_STREAM,
                  {b"stream": stream, b"id": message_id, b"error": error[:500],
                   protocol.PAYLOAD_FIELD: fields.get(protocol.PAYLOAD_FIELD, b"")},
                  maxlen=protocol.STREAM_MAXLEN, approximate=True)
    for handoff in effects.handoffs:
        # No MAXLEN: a handoff is work; decode workers trim what they acknowledged (runtime.trim_acknowledged)
        pipe.xadd(protocol.DECODE_STREAM, {protocol.PAYLOAD_FIELD: protocol.encode(handoff)})
    ids = [m for m, _, _ in effects.dead_letters] + effects.acks
    if ids:
        pipe.xack(stream, group, *ids)


async def write_effects(redis: Any, effects: Effects, stream: str, group: str, transaction: bool = False,
                        store: RedisBlockStore | None = None) -> None:
    """Write `effects`; raises the client's error if a step fails (the caller retries all of it).
    `store`: the block store over the same client (its TTL), by default one with the default TTL."""
    if not effects:
        return
    store = store or RedisBlockStore(redis)
    if not is_cluster(redis):
        pipe = redis.pipeline(transaction=transaction)
        queue_data(pipe, effects, store)
        queue_stream_ops(pipe, effects, stream, group)
        store.queue_deletes(pipe, effects.deletes)  # after the ack: a crash before it must find them
        await pipe.execute()
        return
    if effects.has_data:
        pipe = redis.pipeline(transaction=False)
        queue_data(pipe, effects, store)
        await pipe.execute()
    if effects.has_stream_ops:
        # Always MULTI/EXEC here: its keys share the `{baton}` slot, so it costs nothing, and a
        # handoff is never published without the ack of the prompt it came from (or the reverse).
        pipe = redis.pipeline(transaction=True)
        queue_stream_ops(pipe, effects, stream, group)
        await pipe.execute()
    if effects.deletes:
        pipe = redis.pipeline(transaction=False)
        store.queue_deletes(pipe, effects.deletes)
        await pipe.execute()
