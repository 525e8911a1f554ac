"""Glue shared by the API routes: validate -> tokenize -> admit, wait for the end, stream SSE."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import ApiError
from gateway.generation import ClientGone, Generation
from gateway.services import Services
from gateway.tokenizer import apply_limits
from gateway.validation import GenerationSpec, read_json_body, within


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


async def start_generation(request: Request, status: int,
                           parse: Callable[[dict[str, Any]], GenerationSpec],
                           body: dict[str, Any] | None = None) -> Generation:
    """Everything before the first token; raises ApiError (4xx/429/503) or ClientGone."""
    svc = services(request)
    arrival = time.monotonic()
    try:
        if body is None:
            body = await read_json_body(request, svc.settings, status)
        spec = parse(body)
        prompt_ids = await svc.tokenizer.prompt_ids(spec, status)
        prompt_ids, max_new_tokens = apply_limits(spec, prompt_ids, svc.settings, status)
    except ApiError as exc:
        svc.metrics.reject(rejection_reason(exc))
        raise
    gen = Generation(svc, spec, prompt_ids, max_new_tokens, arrival, status)
    try:
        await gen.begin(request)
    except BaseException:
        gen.close()
        raise
    return gen


async def run_to_end(gen: Generation) -> None:
    """Non-streaming: consume every step, but give up as soon as the client disconnects.

    Raises ClientGone if the client left, GenerationFailed if the request failed.
    """

    async def consume() -> None:
        async for _ in gen.steps():
            pass

    watcher = gen.client_gone
    task = asyncio.create_task(consume())
    waiters: set[asyncio.Future[None]] = {task} if watcher is None else {task, watcher}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled() or not task.done():
        raise ClientGone()
    task.result()


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

    def __init__(self, content: AsyncIterator[bytes], gen: Generation,
                 headers: dict[str, str] | None = None) -> None:
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers={**base, **(headers or {})})
        self._gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        bound = self._gen.svc.settings.stream_write_timeout

        async def send_within(message: Message) -> None:
            try:
                await within(bound, send(message))
            except asyncio.TimeoutError:
                raise ClientNotReading() from None

        try:
            await super().__call__(scope, receive, send_within)
        except ClientNotReading:
            # Returning without finishing the response makes the server close the connection.
            self._gen.abandon("client_not_reading",
                              f"the client read nothing for {bound:g}s (stream_write_timeout)")
        finally:
            self._gen.close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
