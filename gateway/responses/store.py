"""Stored Responses (`store: true`) for `GET /v1/responses/{id}` and `previous_response_id`.

Rules:
- One Redis key per response, `{baton:responses}:response:<id>`, holding JSON: the response object
  as it was answered and the conversation that led to it, as chat messages (the previous
  responses' conversation, this input, then this answer), so a follow-up needs one read to rebuild
  it all. Beside them, under the same hash tag (one Redis Cluster slot, so the scripts below are
  single-slot; not the work streams' `{baton}`, so on a cluster they live on another master): a
  sorted set of the stored ids scored by when each expires, a hash of the bytes each is counted
  for, and their total.
- No key has a Redis TTL: the store's `maxmemory-policy volatile-lru` evicts only keys with one
  (the KV blocks), so a flood of responses never evicts the prefix cache, and KV pressure never
  evicts a response before its time. The gateway enforces both bounds itself, atomically (each
  operation is one script, on Redis' clock, so gateways sharing a Redis agree):
  - expiry: --responses-ttl seconds after it was stored; an expired response reads as gone at
    once, and its keys are deleted by the next save or by the sweep every gateway runs;
  - size: --responses-max-bytes in all (the JSON's bytes plus ENTRY_OVERHEAD each); a save that
    would pass it first drops the responses that expire soonest (the oldest, with one TTL), so the
    newest are kept. One response larger than the whole cap is answered but not stored: its
    object says `store: false` (and a follow-up naming it is a 404).
- --responses-ttl 0 disables storing: nothing is written, and a request naming a previous
  response is refused by name (it could never be found).
- Redis failing is a 503 (ApiError), never a silent loss: a client told `store: true` succeeded
  can count on the follow-up finding it (until it expires, or newer responses push it out).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import redis.asyncio as aioredis

from baton.common.redis_client import REDIS_FAILURES
from gateway.errors import ApiError, unavailable

log = logging.getLogger(__name__)

TAG = "{baton:responses}"
KEY_PREFIX = TAG + ":response:"
INDEX = TAG + ":expiry"  # sorted set: id -> when it expires (ms, Redis' clock)
SIZES = TAG + ":bytes"  # hash: id -> bytes it is counted for
USED = TAG + ":used"  # the sum of SIZES
# Counted per response besides its JSON: its key, index and size entries (so a flood of tiny
# responses is bounded too).
ENTRY_OVERHEAD = 200
SWEEP_LIMIT = 1000  # expired responses deleted per script call (the sweep loops)
SWEEP_INTERVAL_S = 10.0

# Shared by the scripts. KEYS: index, sizes, used. ARGV[1]: the response key prefix.
_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function drop(id)
  local size = tonumber(redis.call('HGET', KEYS[2], id) or '0')
  redis.call('DEL', ARGV[1] .. id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
  if size ~= 0 then redis.call('DECRBY', KEYS[3], size) end
end
local function sweep(now, limit)
  local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(expired) do drop(id) end
  return #expired
end
"""

# ARGV: prefix, id, record, ttl ms, max bytes, bytes counted, sweep limit. Returns how many stored
# responses were dropped to make room, or -1: larger than the cap, not stored.
_SAVE = _COMMON + """
local now = now_ms()
sweep(now, tonumber(ARGV[7]))
local id, size, cap = ARGV[2], tonumber(ARGV[6]), tonumber(ARGV[5])
if size > cap then return -1 end
if redis.call('ZSCORE', KEYS[1], id) then drop(id) end
local dropped = 0
while tonumber(redis.call('GET', KEYS[3]) or '0') + size > cap do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #oldest == 0 then
    redis.call('SET', KEYS[3], 0)  -- nothing is stored: nothing is used
    break
  end
  drop(oldest[1])
  dropped = dropped + 1
end
redis.call('SET', ARGV[1] .. id, ARGV[3])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), id)
redis.call('HSET', KEYS[2], id, size)
redis.call('INCRBY', KEYS[3], size)
return dropped
"""

# ARGV: prefix, id. The record, or nil when there is none or it expired (then it is deleted).
_LOAD = _COMMON + """
local expires = redis.call('ZSCORE', KEYS[1], ARGV[2])
if expires and tonumber(expires) <= now_ms() then
  drop(ARGV[2])
  return false
end
return redis.call('GET', ARGV[1] .. ARGV[2])
"""

# ARGV: prefix, id. 1 when a live response was deleted, else 0.
_DELETE = _COMMON + """
local expires = redis.call('ZSCORE', KEYS[1], ARGV[2])
local existed = redis.call('EXISTS', ARGV[1] .. ARGV[2])
drop(ARGV[2])
if expires and tonumber(expires) <= now_ms() then return 0 end
return existed
"""

# ARGV: prefix, limit. How many expired responses were deleted.
_SWEEP = _COMMON + """
return sweep(now_ms(), tonumber(ARGV[2]))
"""


def response_key(response_id: str) -> str:
    return KEY_PREFIX + response_id


class ResponseStore:
    """The stored responses of one gateway's Redis; `ttl` seconds each (0: none are kept), at most
    `max_bytes` in all (shared with every gateway of that Redis)."""

    def __init__(self, redis: aioredis.Redis, ttl: int, max_bytes: int, retry_after_s: int) -> None:
        self.redis = redis
        self.ttl = ttl
        self.retry_after_s = retry_after_s
        self.max_bytes = max_bytes

    @property
    def enabled(self) -> bool:
        return self.ttl > 0

    async def _run(self, script: str, *args: Any) -> Any:
        return await self.redis.eval(script, 3, INDEX, SIZES, USED, KEY_PREFIX, *args)

    async def save(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store it; False when it alone is larger than --responses-max-bytes (not stored)."""
        record = json.dumps({"response": response, "conversation": conversation}, ensure_ascii=False).encode()
        size = len(record) + ENTRY_OVERHEAD
        try:
            dropped = await self._run(_SAVE, response["id"], record, self.ttl * 1000, self.max_bytes, size,
                                      SWEEP_LIMIT)
        except REDIS_FAILURES as exc:
            raise self._down("store the response", exc) from None
        if dropped < 0:
            log.warning("response %s not stored: %d bytes, over --responses-max-bytes (%d)",
                        response["id"], size, self.max_bytes)
            return False
        if dropped:
            log.info("dropped the %d oldest stored response(s) to stay within --responses-max-bytes (%d)",
                     dropped, self.max_bytes)
        return True

    async def load(self, response_id: str, param: str) -> dict[str, Any]:
        """The stored record ({"response", "conversation"}); a 404 naming `param` when there is none."""
        if not self.enabled:
            raise ApiError(404 if param == "response_id" else 400,
                           f"`{param}`: this server stores no responses (--responses-ttl 0)", param=param,
                           kind="not_found" if param == "response_id" else "validation")
        try:
            raw = await self._run(_LOAD, response_id)
        except REDIS_FAILURES as exc:
            raise self._down("read the stored response", exc) from None
        if raw is None:
            raise ApiError(404, f"Response with id '{response_id}' not found (`{param}`; stored responses "
                                f"expire after {self.ttl} s, and the oldest are dropped past "
                                f"--responses-max-bytes).", kind="not_found", param=param)
        record: dict[str, Any] = json.loads(raw)
        return record

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self._run(_DELETE, response_id))
        except REDIS_FAILURES as exc:
            raise self._down("delete the response", exc) from None

    async def sweep(self) -> int:
        """Delete every expired response; how many went (a Redis failure raises)."""
        total = 0
        while True:
            count = int(await self._run(_SWEEP, SWEEP_LIMIT))
            total += count
            if count < SWEEP_LIMIT:
                return total

    async def sweep_forever(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """The gateway's background task: expired responses leave Redis even when nothing is saved.
        Redis failures are the cluster task's to report; this one tries again next time."""
        while self.enabled:
            try:
                await self.sweep()
            except REDIS_FAILURES as exc:
                log.debug("sweeping expired responses failed: %s", exc)
            await asyncio.sleep(interval_s)

    def _down(self, what: str, exc: BaseException) -> ApiError:
        return unavailable(f"redis is unreachable ({type(exc).__name__}: {str(exc)[:200]}); cannot {what}",
                           self.retry_after_s)
