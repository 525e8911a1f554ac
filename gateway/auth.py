"""Bearer-token auth for generation endpoints and /stats (when an API key is configured).

The key is accepted as `Authorization: Bearer KEY` or as `x-api-key: KEY` (what Anthropic's clients
send), on every protected path.

A plain ASGI middleware (not BaseHTTPMiddleware, which would buffer streaming responses). /health,
/ready, /live, /metrics, /info, /version and /openapi.json stay open: probes and scrapers must not need the key.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import ApiError, api_style, error_response

PROTECTED_PATHS = frozenset({
    "/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions", "/v1/models",
    "/tokenize", "/detokenize", "/stats",
    "/v1/messages", "/v1/messages/count_tokens",
})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self._expected is None or scope["type"] != "http"
                or scope["path"] not in PROTECTED_PATHS
                or (scope["path"] == "/" and scope["method"] != "POST")):
            await self.app(scope, receive, send)
            return
        provided = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                provided = value
                break
            if name == b"x-api-key" and not provided:  # Anthropic's header, as a bearer token
                provided = b"Bearer " + value
        # Constant-time comparison: the key must not leak through response timing.
        if hmac.compare_digest(provided, self._expected):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)" if not provided
                   else "invalid API key")
        err = ApiError(401, message, kind="authentication", headers={"WWW-Authenticate": "Bearer"})
        await error_response(err, api_style(scope["path"]))(scope, receive, send)
