"""Redis backend of the block store: KV blocks as binary values keyed by their chained hash.

A full block's key is `baton:kv:<hash>`: any worker computing the same prefix writes the same key
(SET NX: the first write wins; the content is the same anyway). Block keys carry no hash tag, so on
a Redis Cluster they spread over every master (the store's memory is the cluster's). The prompt's
last, partial block has no hash (its content is not final) and travels keyed by request. Every
value carries its tokens, so a reader re-checks them on a hit, and its dtype and shape, so a worker
in another dtype converts.
Values have a TTL; the server's `maxmemory` with `volatile-lru` caps the store's memory by evicting
least-recently-used blocks (never the streams, which have no TTL).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgpack
import torch
from redis.asyncio import Redis

KEY_PREFIX = "baton:kv:"
PARTIAL_PREFIX = "baton:kv:partial:"
DEFAULT_TTL_S = 900


def is_cluster(client: object) -> bool:
    """Whether `client` (or the client of a pipeline) talks to a Redis Cluster: there, writes to
    keys of different slots are neither ordered nor atomic within one pipeline. (Here, in the bottom
    layer, so the store imports nothing from baton; the workers' writer asks it too.)"""
    from redis.asyncio.cluster import ClusterPipeline, RedisCluster
    from redis.cluster import ClusterPipeline as SyncClusterPipeline, RedisCluster as SyncRedisCluster

    return isinstance(client, (RedisCluster, SyncRedisCluster, ClusterPipeline, SyncClusterPipeline))


def block_key(block_hash: str) -> str:
    return KEY_PREFIX + block_hash


def partial_key(request_id: str) -> str:
    return PARTIAL_PREFIX + request_id


def encode_block(token_ids: Sequence[int], kv: torch.Tensor) -> bytes:
    """kv: [layers, 2, block_size, kv_heads, head_dim] -> bytes (tokens, dtype, shape, raw data)."""
    kv = kv.contiguous()
    return msgpack.packb({
        "v": 1,
        "tokens": list(token_ids),
        "dtype": str(kv.dtype).removeprefix("torch."),
        "shape": list(kv.shape),
        "data": kv.view(torch.uint8).numpy().tobytes(),
    }, use_bin_type=True)


# The dtypes a block may hold (what a worker computes in); anything else is no KV of ours.
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode_block(value: bytes) -> tuple[list[int], torch.Tensor]:
    """bytes -> (token ids, kv [layers, 2, block_size, kv_heads, head_dim]). Raises ValueError for
    a value that is no well-formed block: anyone who can write to Redis can write this key, so the
    dtype, the shape and the byte length are checked, not trusted (the caller checks the shape
    against its own model's)."""
    payload = msgpack.unpackb(value, raw=False)
    if not isinstance(payload, dict) or payload.get("v") != 1:
        raise ValueError("not a Baton KV block")
    tokens, name, shape, data = (payload.get(k) for k in ("tokens", "dtype", "shape", "data"))
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ValueError("its tokens are not a list of ints")
    if name not in KV_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(KV_DTYPES)}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"shape {shape!r} is not a list of sizes")
    dtype = KV_DTYPES[name]
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{len(data) if isinstance(data, bytes) else type(data).__name__} bytes of data "
                         f"for {name} {shape}")
    if not data:
        return list(tokens), torch.empty(shape, dtype=dtype)
    return list(tokens), torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class RedisBlockStore:
    def __init__(self, redis: Redis, ttl_s: int = DEFAULT_TTL_S) -> None:
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
        """Remove these keys (one DEL each, in one round trip: on a Redis Cluster they may lie on
        several masters). For blocks found malformed: full blocks are written with SET NX, so a
        poisoned key would otherwise keep the good block out until its TTL."""
        if not keys:
            return
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.delete(key)
        await pipe.execute()

    def queue_put_block(self, pipe, block_hash: str, value: bytes) -> None:
        """Add a full block's write to a pipeline (the caller batches it with its other writes)."""
        pipe.set(block_key(block_hash), value, ex=self.ttl_s, nx=True)

    def queue_put_partial(self, pipe, request_id: str, value: bytes) -> str:
        """Add the partial block's write to a pipeline; returns its key (the handoff carries it)."""
        key = partial_key(request_id)
        pipe.set(key, value, ex=self.ttl_s)
        return key
