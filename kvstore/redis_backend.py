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

from collections.abc import Sequence

import msgpack
import torch
from redis.asyncio import Redis

from baton.redis_client import is_cluster

KEY_PREFIX = "baton:kv:"
PARTIAL_PREFIX = "baton:kv:partial:"
DEFAULT_TTL_S = 900


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


def decode_block(value: bytes) -> tuple[list[int], torch.Tensor]:
    """bytes -> (token ids, kv [layers, 2, block_size, kv_heads, head_dim])."""
    payload = msgpack.unpackb(value, raw=False)
    if not isinstance(payload, dict) or payload.get("v") != 1:
        raise ValueError("not a Baton KV block")
    dtype = getattr(torch, payload["dtype"])
    data = torch.frombuffer(bytearray(payload["data"]), dtype=torch.uint8)
    return list(payload["tokens"]), data.view(dtype).reshape(payload["shape"])


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

    def queue_put_block(self, pipe, block_hash: str, value: bytes) -> None:
        """Add a full block's write to a pipeline (the caller batches it with its other writes)."""
        pipe.set(block_key(block_hash), value, ex=self.ttl_s, nx=True)

    def queue_put_partial(self, pipe, request_id: str, value: bytes) -> str:
        """Add the partial block's write to a pipeline; returns its key (the handoff carries it)."""
        key = partial_key(request_id)
        pipe.set(key, value, ex=self.ttl_s)
        return key
