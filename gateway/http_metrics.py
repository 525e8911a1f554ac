"""Requests and their latency by endpoint: `baton:http_requests_total{endpoint, method, status}` and
`baton:http_request_duration_seconds{endpoint}`, every route counted the same way (what vLLM's
`http_requests_total{handler, method, status}` gives a dashboard).

`endpoint` is the route's path template (`/v1/responses/{response_id}`, never the id itself), so
the series stay few: a path no route serves is counted as `unmatched`. The duration runs from the
request's arrival to its last body byte, a stream's whole length included; a request whose
handler raised counts as the 500 the client got.

Every label is bounded whatever a client sends: `method` is one of the standard methods or `other`
(2000 requests with distinct made-up methods once added 2000 series), `endpoint` a route template or
`unmatched` (a flood of random paths adds one series), `status` what this server answered.

A plain ASGI middleware just inside the request-id one, so a refused Host or API key is counted
under its route too (an operator sees the 401s); bounded labels make that safe against a flood.
The metrics object is the app's (`app.state.services`, built in the lifespan).
"""

from __future__ import annotations

import time

from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "unmatched"
OTHER_METHOD = "other"
STANDARD_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})


def method_label(method: str) -> str:
    """The method as a label value: a standard one as is, anything else (any case, any length) `other`."""
    return method if method in STANDARD_METHODS else OTHER_METHOD


def endpoint_of(scope: Scope) -> str:
    """The path template of the route that served `scope` (set by Starlette's router), else
    the first route whose template matches it (a request refused before routing)."""
    route = scope.get("route")
    if isinstance(route, Route):
        return route.path
    app = scope.get("app")
    for candidate in getattr(app, "routes", ()):
        if isinstance(candidate, Route) and candidate.path_regex.match(scope.get("path", "")):
            return candidate.path
    return UNMATCHED


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500  # what the client gets when the handler raises before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            services = getattr(scope["app"].state, "services", None)
            if services is not None:
                services.metrics.http_request(endpoint_of(scope), method_label(scope["method"]), status,
                                              time.monotonic() - started)
