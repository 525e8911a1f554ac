"""Host header check against DNS rebinding.

A page on evil.example can make its own name resolve to 127.0.0.1 and then read a local server as
if it were same-origin; the one thing it cannot change is the Host header, which stays
`evil.example`. So a gateway bound to loopback answers only Host values that name loopback.
Bound to another address, it accepts any Host unless `allowed_hosts` lists names. Loopback names
are always accepted: a page cannot rebind them.

A plain ASGI middleware, outermost, so nothing else (auth included) runs for a refused request.
"""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import Settings
from gateway.errors import ApiError, api_style, error_response


def is_loopback(host: str) -> bool:
    """`localhost`, `*.localhost` (RFC 6761), 127.0.0.0/8 or ::1 (any case, trailing dot or not)."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def exposure_warning(host: str, port: int, api_key: str | None) -> str | None:
    """The start-up warning for an API that anyone on the network may use: bound beyond loopback
    (0.0.0.0, ::, a LAN address) with no API key. None when bound to loopback or given a key."""
    if api_key or is_loopback(host.strip("[]")):
        return None
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else (host or "0.0.0.0")
    return (f"listening on {shown}:{port} without --api-key: anyone who can reach this address can use "
            "the API; pass --api-key (or set BATON_API_KEY), or bind 127.0.0.1")


def host_name(header: str) -> str:
    """The name in a Host header, without port or IPv6 brackets, lower case."""
    header = header.strip()
    if header.startswith("["):  # [v6] or [v6]:port
        return header[1:header.find("]")].lower() if "]" in header else ""
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.lower().rstrip(".")


def allowed_names(settings: Settings) -> frozenset[str] | None:
    """The Host names accepted besides loopback ones; None: any Host."""
    if settings.allowed_hosts is None:
        return frozenset() if is_loopback(settings.host) else None
    names = {name.strip().lower().rstrip(".") for name in settings.allowed_hosts if name.strip()}
    return None if "*" in names else frozenset(names)


class HostCheckMiddleware:
    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None) -> None:
        self.app = app
        self._allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._allowed is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((value for name, value in scope.get("headers", []) if name == b"host"), None)
        # No Host at all (HTTP/1.0) cannot come from a browser, so it cannot be a rebinding attack.
        name = host_name(header.decode("latin-1")) if header is not None else None
        if name is None or is_loopback(name) or name in self._allowed:
            await self.app(scope, receive, send)
            return
        err = ApiError(400, f"Host {name[:100]!r} is not allowed; this server answers only "
                            f"{self._describe()} (set --allowed-hosts or BATON_ALLOWED_HOSTS)",
                       kind="invalid_host")
        await error_response(err, api_style(scope["path"]))(scope, receive, send)

    def _describe(self) -> str:
        names = ", ".join(sorted(self._allowed or ()))
        return "loopback names" + (f" and {names}" if names else "")
