"""Where blocks live in the store: a full block under its chained hash, the partial last block of a
handoff and a hybrid model's state at the end of the prompt under its request id. The only place
that spells a store key."""

from __future__ import annotations

KEY_PREFIX = "baton:kv:"
PARTIAL_PREFIX = "baton:kv:partial:"
STATE_PREFIX = "baton:kv:state:"


def block_key(block_hash: str) -> str:
    return KEY_PREFIX + block_hash


def partial_key(request_id: str) -> str:
    return PARTIAL_PREFIX + request_id


def state_key(request_id: str) -> str:
    """A handed-off request's state layers' state at the end of its prompt (written beside its
    partial block, read and deleted by the decode worker like it)."""
    return STATE_PREFIX + request_id
