"""API-key auth, deny by default: with a key configured, every request needs it except OPEN_ROUTES.

The key is accepted as `Authorization: Bearer KEY` or as `x-api-key: KEY` (what Anthropic's clients
send). Open without it are only the probes and the scraper (GET/HEAD of /health, /ready, /live,
/metrics, /version) and the dashboard's login form post, which checks the key it carries itself
(gateway.dashboard_login). Everything else, /info, /openapi.json, unknown paths and any route added
later included, answers 401 without the key: an allow-list of protected paths once left new routes
(/v1/responses, /v1/embeddings, /embed) open, and a list of open ones cannot fail that way.

/openapi.json is not open: no probe needs it, it names the model and the limits, and a client that
reads it holds the key anyway.

A browser sends no header, so the dashboard's session cookie (gateway.dashboard_login) also
authenticates COOKIE_ROUTES, and only those: the dashboard's own read-only GETs. A cookie is sent by
the browser on its own, so accepting it on generation POSTs (or /stats, or DELETE) would let another
site's page spend this gateway's compute or delete stored responses through a logged-in browser
(CSRF). SameSite=Strict already stops that in current browsers; restricting the cookie to what the
page fetches means a browser that ignores SameSite gains nothing either.

A plain ASGI middleware (not BaseHTTPMiddleware, which would buffer streaming responses).
"""

from __future__ import annotations

import hmac
from http.cookies import CookieError, SimpleCookie

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.dashboard_login import COOKIE_NAME, LOGIN_PATH, login_page, session_valid
from gateway.errors import ApiError, api_style, error_response

READ_METHODS = frozenset({"GET", "HEAD"})
# Probes and scrapers: a load balancer, Kubernetes or Prometheus must not need the key.
OPEN_ROUTES = frozenset({"/health", "/ready", "/live", "/metrics", "/version"})
COOKIE_ROUTES = frozenset({"/dashboard", "/dashboard/data"})


def is_open(path: str, method: str) -> bool:
    """A request served without the key even when one is configured."""
    return (path in OPEN_ROUTES and method in READ_METHODS) or (path == LOGIN_PATH and method == "POST")


def route_path(scope: Scope) -> str:
    """The path the router matches: Starlette's own rule (starlette._utils.get_route_path) for a
    `root_path` prefix, so that this check and the router never disagree about which route it is."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        return path[len(root):]
    return path


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._key = api_key
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._expected is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path, method = route_path(scope), scope.get("method", "GET")
        provided = self._provided(scope)
        if is_open(path, method) or hmac.compare_digest(provided, self._expected) \
                or self._session(scope, path, method):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # no route speaks it today; refused before any is added
            await send({"type": "websocket.close", "code": 1008})
            return
        if path == "/dashboard" and method in READ_METHODS and _wants_html(scope):
            # A browser opening the dashboard: the login form, not a JSON error it cannot act on.
            await login_page("dashboard/login")(scope, receive, send)
            return
        message = ("missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)" if not provided
                   else "invalid API key")
        err = ApiError(401, message, kind="authentication", headers={"WWW-Authenticate": "Bearer"})
        await error_response(err, api_style(path))(scope, receive, send)

    @staticmethod
    def _provided(scope: Scope) -> bytes:
        """The credential sent, as `Bearer <key>` bytes (b"" when none)."""
        provided = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                return value
            if name == b"x-api-key" and not provided:  # Anthropic's header, as a bearer token
                provided = b"Bearer " + value
        return provided

    def _session(self, scope: Scope, path: str, method: str) -> bool:
        """A valid dashboard session cookie on one of the routes it may open (COOKIE_ROUTES, GET)."""
        if path not in COOKIE_ROUTES or method not in READ_METHODS or self._key is None:
            return False
        for name, value in scope.get("headers", []):
            if name != b"cookie":
                continue
            try:
                morsel = SimpleCookie(value.decode("latin-1")).get(COOKIE_NAME)
            except CookieError:  # a malformed Cookie header authenticates nothing
                continue
            if morsel is not None and session_valid(self._key, morsel.value):
                return True
        return False


def _wants_html(scope: Scope) -> bool:
    accept = next((value for name, value in scope.get("headers", []) if name == b"accept"), b"")
    return b"text/html" in accept
