"""Writing a worker's `Effects` to Redis in their safe order (docs/design-decisions.md §5).

On one Redis, one pipeline carries them all (MULTI/EXEC when the caller asks): Redis runs a
pipeline's commands in order. On a Redis Cluster a pipeline is split by node and the nodes run
their parts concurrently, so order between slots holds only between round trips: the data (blocks,
partial block, token events) is written and acknowledged first, then the stream operations
(handoffs, dead letters, acks: one slot, one MULTI/EXEC), then the deletes. Each step may be
retried whole, so a failure or a crash between them is safe.
"""

from __future__ import annotations

from typing import Any

from baton.worker.core import Effects, queue_data, queue_deletes, queue_effects, queue_stream_ops
from kvstore.redis_backend import DEFAULT_TTL_S, is_cluster


async def write_effects(redis: Any, effects: Effects, stream: str, group: str, transaction: bool = False,
                        ttl_s: int = DEFAULT_TTL_S) -> None:
    """Write `effects`; raises the client's error if a step fails (the caller retries all of it)."""
    if not effects:
        return
    if not is_cluster(redis):
        pipe = redis.pipeline(transaction=transaction)
        queue_effects(pipe, effects, stream, group, ttl_s)
        await pipe.execute()
        return
    if effects.has_data:
        pipe = redis.pipeline(transaction=False)
        queue_data(pipe, effects, ttl_s)
        await pipe.execute()
    if effects.has_stream_ops:
        # Always MULTI/EXEC here: its keys share the `{baton}` slot, so it costs nothing, and a
        # handoff is never published without the ack of the prompt it came from (or the reverse).
        pipe = redis.pipeline(transaction=True)
        queue_stream_ops(pipe, effects, stream, group)
        await pipe.execute()
    if effects.deletes:
        pipe = redis.pipeline(transaction=False)
        queue_deletes(pipe, effects)
        await pipe.execute()
