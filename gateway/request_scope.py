"""Every generation a request starts is released when its HTTP exchange ends, whatever the route.

TGI's router frees a request's resources when the request is dropped; Python has no drop, so this
middleware is the one place that plays that part. A route registers each `Generation` it creates
(`own`) before asking for admission; when the ASGI call returns or raises (the response sent, a
stream finished or cut, the client gone, a bug in a route), every registered generation is
`close()`d: its token budget goes back to admission, its event queue is dropped, and the workers
get a Cancel for anything still running. `close()` is idempotent, so routes that close in their
own `finally` (to answer sooner) lose nothing by it; a route that forgets, or fails between
admission and its own cleanup, can no longer leak a reservation.
"""

from __future__ import annotations

from typing import Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

SCOPE_KEY = "baton.owned_generations"


class Closable(Protocol):
    def close(self) -> None: ...


def own(scope: Scope, *generations: Closable) -> None:
    """Hand `generations` to the request's scope: they are closed when the exchange ends."""
    owned = scope.get(SCOPE_KEY)
    if owned is None:  # an app without the middleware (unit tests): the route's own finally holds
        return
    owned.extend(generations)


class ReleaseOnExitMiddleware:
    """Closes the generations a request owns once its ASGI call is over (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        owned: list[Closable] = []
        scope[SCOPE_KEY] = owned
        try:
            await self.app(scope, receive, send)
        finally:
            for generation in owned:
                generation.close()
