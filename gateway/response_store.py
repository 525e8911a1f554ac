"""Stored Responses (`store: true`) for `GET /v1/responses/{id}` and `previous_response_id`.

Rules:
- One Redis key per response, `{baton}:response:<id>` (the `{baton}` hash tag of
  baton.common.protocol, so it works on Redis Cluster), holding JSON: the response object as it
  was answered and the conversation that led to it, as chat messages (the previous responses'
  conversation, this input, then this answer), so a follow-up needs one read to rebuild it all.
- Each key expires after --responses-ttl seconds; 0 disables storing: nothing is written, and a
  request naming a previous response is refused by name (it could never be found).
- Redis failing is a 503 (ApiError), never a silent loss: a client told `store: true` succeeded
  can count on the follow-up finding it.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from baton.common.protocol import PIPELINE_TAG
from baton.common.redis_client import REDIS_FAILURES
from gateway.errors import ApiError, unavailable

KEY_PREFIX = PIPELINE_TAG + ":response:"


def response_key(response_id: str) -> str:
    return KEY_PREFIX + response_id


class ResponseStore:
    """The stored responses of one gateway's Redis; `ttl` seconds each (0: none are kept)."""

    def __init__(self, redis: aioredis.Redis, ttl: int, retry_after_s: int) -> None:
        self.redis = redis
        self.ttl = ttl
        self.retry_after_s = retry_after_s

    @property
    def enabled(self) -> bool:
        return self.ttl > 0

    async def save(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        record = json.dumps({"response": response, "conversation": conversation}, ensure_ascii=False)
        try:
            await self.redis.set(response_key(response["id"]), record, ex=self.ttl)
        except REDIS_FAILURES as exc:
            raise self._down("store the response", exc) from None

    async def load(self, response_id: str, param: str) -> dict[str, Any]:
        """The stored record ({"response", "conversation"}); a 404 naming `param` when there is none."""
        if not self.enabled:
            raise ApiError(404 if param == "response_id" else 400,
                           f"`{param}`: this server stores no responses (--responses-ttl 0)", param=param,
                           kind="not_found" if param == "response_id" else "validation")
        try:
            raw = await self.redis.get(response_key(response_id))
        except REDIS_FAILURES as exc:
            raise self._down("read the stored response", exc) from None
        if raw is None:
            raise ApiError(404, f"Response with id '{response_id}' not found (`{param}`; stored responses "
                                f"expire after {self.ttl} s).", kind="not_found", param=param)
        record: dict[str, Any] = json.loads(raw)
        return record

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self.redis.delete(response_key(response_id)))
        except REDIS_FAILURES as exc:
            raise self._down("delete the response", exc) from None

    def _down(self, what: str, exc: BaseException) -> ApiError:
        return unavailable(f"redis is unreachable ({type(exc).__name__}: {str(exc)[:200]}); cannot {what}",
                           self.retry_after_s)
