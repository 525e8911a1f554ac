"""`x-request-id`: the client's id for a request, honoured, echoed on every response, logged.

A client (or the proxy in front of the gateway) that sends `x-request-id` gets the same value back
on every response, errors included, and finds it on every log line about that request in the
gateway and in the workers (it travels in PrefillRequest and Handoff as `client_request_id`). An
id that is missing, too long or not printable ASCII is replaced by a generated one, never rewritten.

This id is the client's, not Baton's: the internal request id (which names the request on the
streams and in cancels) stays separate, so two clients sending the same id cannot collide.

A plain ASGI middleware, outermost among ours. A 500 from an unexpected exception is answered by
Starlette's outer ServerErrorMiddleware with its own `send`, so the id is also kept in the scope
(`client_request_id(scope)`) for that handler to add.
"""

from __future__ import annotations

import uuid
from collections.abc import MutableMapping
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton.common.logs import bind_client_id, sanitize_client_id

HEADER = "x-request-id"
_SCOPE_KEY = "baton.client_request_id"


def client_request_id(scope: MutableMapping[str, Any]) -> str:
    """The id this request answers with ("" outside an HTTP request)."""
    return scope.get(_SCOPE_KEY, "")


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), b"")
        rid = sanitize_client_id(sent.decode("latin-1")) or uuid.uuid4().hex
        scope[_SCOPE_KEY] = rid
        bind_client_id(rid)  # this task's log lines (and the tasks it starts) carry it

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers[HEADER] = rid  # replaces any other value: one id per response
            await send(message)

        await self.app(scope, receive, send_with_id)
