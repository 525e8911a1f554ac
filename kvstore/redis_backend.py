"""Redis backend of the block store: KV blocks as binary values keyed by their chained hash.

A full block's key is `baton:kv:<hash>` (kvstore.keys): any worker computing the same prefix writes
the same key (SET NX: the first write wins; the content is the same anyway). Block keys carry no
hash tag, so on a Redis Cluster they spread over every master (the store's memory is the cluster's).
The prompt's last, partial block has no hash (its content is not final) and travels keyed by request.
Values have a TTL; the server's `maxmemory` with `volatile-lru` caps the store's memory by evicting
least-recently-used blocks (never the streams, which have no TTL).

Reads run here (one round trip each); writes are queued on the caller's pipeline (`queue_writes`),
because a worker batches them with its stream operations in one safe order (baton/worker/writer.py).
The client may be redis-py's (one server or a cluster) or kvstore.memory_backend's stand-in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.keys import block_key

DEFAULT_TTL_S = 900


def is_cluster(client: object) -> bool:
    """Whether `client` (or the client of a pipeline) talks to a Redis Cluster: there, writes to
    keys of different slots are neither ordered nor atomic within one pipeline. (Here, in the bottom
    layer, so the store imports nothing from baton; the workers' writer asks it too.)"""
    from redis.asyncio.cluster import ClusterPipeline, RedisCluster
    from redis.cluster import ClusterPipeline as SyncClusterPipeline, RedisCluster as SyncRedisCluster

    return isinstance(client, (RedisCluster, SyncRedisCluster, ClusterPipeline, SyncClusterPipeline))


class RedisBlockStore:
    def __init__(self, redis: Any, ttl_s: int = DEFAULT_TTL_S) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which of these keys are present; one round trip."""
        if not keys:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in await pipe.execute()]

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Raw values of these keys (None where absent); one round trip (on a Redis Cluster, one
        MGET per slot, sent together: block keys have no hash tag, they spread over the masters)."""
        if not keys:
            return []
        if is_cluster(self.redis):
            return await self.redis.mget_nonatomic(list(keys))
        return await self.redis.mget(list(keys))

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove these keys now, in one round trip (for blocks found malformed: full blocks are
        written with SET NX, so a poisoned key would otherwise keep the good block out until its TTL)."""
        if not keys:
            return
        pipe = self.redis.pipeline(transaction=False)
        self.queue_deletes(pipe, keys)
        await pipe.execute()

    def queue_writes(self, pipe: Any, blocks: Sequence[tuple[str, bytes]], refreshes: Sequence[str],
                     partials: Sequence[tuple[str, bytes]]) -> None:
        """Queue on `pipe`: full blocks by hash (SET NX: the first write wins, the content is the
        same), TTL refreshes of blocks in use (a shared prefix must not expire under its readers),
        and partial blocks by their store key. All may be written twice: a retry is safe."""
        for block_hash, value in blocks:
            pipe.set(block_key(block_hash), value, ex=self.ttl_s, nx=True)
        for block_hash in refreshes:
            pipe.expire(block_key(block_hash), self.ttl_s)
        for key, value in partials:
            pipe.set(key, value, ex=self.ttl_s)

    @staticmethod
    def queue_deletes(pipe: Any, keys: Sequence[str]) -> None:
        """One DEL per key: on a Redis Cluster the keys live on different slots."""
        for key in keys:
            pipe.delete(key)
