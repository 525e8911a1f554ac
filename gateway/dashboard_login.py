"""The dashboard's login with an API key configured: a browser sends no `Authorization` header, so
`GET /dashboard` answers a browser's navigation with a small login form (status 401), the form posts
the key to `POST /dashboard/login`, and a right key gets a session cookie and a redirect back.

The cookie is not the key: it is `<expiry>.<HMAC-SHA256(key, label + expiry)>`, valid for
SESSION_SECONDS. Derived from the key rather than from a per-process random secret, so that every
gateway sharing the key (Kubernetes runs two behind one Service) accepts it and a restart does not
log anyone out; changing the key ends every session. It is HttpOnly (page scripts cannot read it),
SameSite=Strict (no other site's page makes the browser send it), Path=/ and Secure over HTTPS.

What the cookie authenticates is decided in gateway.auth (`COOKIE_ROUTES`): only the dashboard's
own read-only GETs. The key itself never travels in a URL (so never in an access log).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import time
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gateway.validation import _read_capped, within

COOKIE_NAME = "baton_dashboard_session"
SESSION_SECONDS = 12 * 3600
LOGIN_PATH = "/dashboard/login"
_LABEL = b"baton-dashboard-session:"
_MAX_FORM_BYTES = 4096  # a key and a field name; anything longer is not a login


def session_token(api_key: str, expires: int) -> str:
    mac = hmac.new(api_key.encode(), _LABEL + str(expires).encode(), hashlib.sha256).hexdigest()
    return f"{expires}.{mac}"


def session_valid(api_key: str, token: str, now: float | None = None) -> bool:
    """Whether `token` is a session cookie this key issued and that has not expired."""
    expires_text, dot, _mac = token.partition(".")
    if not dot or not expires_text.isdigit() or len(expires_text) > 12:
        return False
    expires = int(expires_text)
    if expires < (time.time() if now is None else now):
        return False
    # Constant time: the cookie must not be guessable byte by byte from response timing.
    return hmac.compare_digest(session_token(api_key, expires).encode(), token.encode("utf-8", "replace"))


def login_page(action: str, message: str = "") -> HTMLResponse:
    """The login form (status 401: the request was not authenticated). `action` is relative, so the
    form works behind a path prefix, as the dashboard's own data URL does."""
    note = f'<p class="error" id="login-error">{html.escape(message)}</p>' if message else ""
    body = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Baton dashboard: log in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font:15px system-ui,sans-serif;background:#111;color:#eee;display:grid;place-items:center;
height:100vh;margin:0}}form{{background:#1c1c1c;padding:24px;border-radius:8px;min-width:280px}}
input{{width:100%;box-sizing:border-box;margin:8px 0 12px;padding:8px}}.error{{color:#f77}}</style>
</head><body><form id="login" method="post" action="{html.escape(action)}">
<h1>Baton dashboard</h1><p>This gateway requires its API key.</p>{note}
<label for="key">API key</label><input id="key" name="key" type="password" autocomplete="current-password"
required autofocus><button type="submit">Log in</button></form></body></html>"""
    return HTMLResponse(body, status_code=401, headers={"Cache-Control": "no-store",
                                                        "WWW-Authenticate": "Bearer"})


async def login(request: Request) -> Response:
    """`POST /dashboard/login` with the form field `key`: 303 to the dashboard with the session cookie
    when it is the API key, else 401 and the form again (no cookie)."""
    settings = request.app.state.services.settings
    back = RedirectResponse("../dashboard", status_code=303, headers={"Cache-Control": "no-store"})
    if not settings.api_key:  # nothing to log in to
        return back
    try:
        raw = await within(settings.body_read_timeout, _read_capped(request, _MAX_FORM_BYTES))
    except asyncio.TimeoutError:
        return login_page("login", "the form was not received in time")
    try:
        provided = parse_qs(raw.decode("utf-8", "replace"), max_num_fields=4).get("key", [""])[0]
    except ValueError:  # more fields than a login form has
        provided = ""
    if not hmac.compare_digest(provided.encode("utf-8", "replace"), settings.api_key.encode()):
        return login_page("login", "wrong API key" if provided else "enter the API key")
    expires = int(time.time()) + SESSION_SECONDS
    back.set_cookie(COOKIE_NAME, session_token(settings.api_key, expires), max_age=SESSION_SECONDS, path="/",
                    secure=request.url.scheme == "https", httponly=True, samesite="strict")
    return back
