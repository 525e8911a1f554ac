"""Glue shared by the API routes: services, rejection labels, the SSE response (see gateway.choices
for validate -> tokenize -> admit -> wait for the end)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import ApiError
from gateway.generation import Generation
from gateway.services import Services
from gateway.validation import within


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


def rejection_reason(exc: ApiError) -> str:
    """The metrics label of a request refused while reading or checking it."""
    return {413: "payload_too_large", 415: "unsupported_media_type", 408: "body_timeout"}.get(
        exc.status, "validation")


def client_gone_response() -> Response:
    # Nobody will read it; 499 is the conventional "client closed request" status in access logs.
    return Response(status_code=499)


class ClientNotReading(Exception):
    """Writing one stream event to the client took longer than stream_write_timeout."""


class SSEResponse(StreamingResponse):
    """A server-sent-events stream whose cleanup cannot be skipped.

    Starlette cancels the body iterator when the client disconnects, but an iterator suspended at
    `yield` when that happens would only be finalized by the garbage collector; so the cleanup
    (`gen.close()`) runs here, in `finally`, whatever way the response ends.

    A client that stays connected but stops reading is as gone as one that disconnected: once the
    connection's buffers are full, a write waits for it forever, holding the request's slot and
    token budget. A write that takes longer than stream_write_timeout ends the request.
    """

    def __init__(self, content: AsyncIterator[bytes], gens: Generation | list[Generation],
                 headers: dict[str, str] | None = None) -> None:
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers={**base, **(headers or {})})
        self._gens = gens if isinstance(gens, list) else [gens]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        bound = self._gens[0].svc.settings.stream_write_timeout

        async def send_within(message: Message) -> None:
            try:
                await within(bound, send(message))
            except asyncio.TimeoutError:
                raise ClientNotReading() from None

        try:
            await super().__call__(scope, receive, send_within)
        except ClientNotReading:
            # Returning without finishing the response makes the server close the connection.
            for gen in self._gens:
                gen.abandon("client_not_reading", f"the client read nothing for {bound:g}s (stream_write_timeout)")
        finally:
            for gen in self._gens:
                gen.close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
