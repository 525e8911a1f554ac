"""Where blocks live in the store: a full block under its chained hash, the partial last block of a
handoff under its request id. The only place that spells a store key."""

from __future__ import annotations

KEY_PREFIX = "baton:kv:"
PARTIAL_PREFIX = "baton:kv:partial:"


def block_key(block_hash: str) -> str:
    return KEY_PREFIX + block_hash


def partial_key(request_id: str) -> str:
    return PARTIAL_PREFIX + request_id
