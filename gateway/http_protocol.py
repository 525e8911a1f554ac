"""uvicorn's HTTP/1.1 protocol (h11) with a deadline for each request's headers.

uvicorn bounds the idle time between requests (timeout_keep_alive) but not the time a client may
take to send a request's headers once it has started: a client trickling a header byte every few
seconds (slowloris) holds its connection forever, and a few hundred of them exhaust the process's
file descriptors. Here the headers of each request must be complete within header_read_timeout of
the connection opening or of the previous response ending; the app bounds the body itself
(body_read_timeout).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.config import Settings


class HeaderDeadlineProtocol(H11Protocol):
    header_read_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's headers get the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_read_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        # IDLE: h11 has not seen a complete request line and headers since the deadline was set.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def http_protocol(settings: Settings) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn (`http=`), with this gateway's header deadline."""
    return type("GatewayHTTPProtocol", (HeaderDeadlineProtocol,),
                {"header_read_timeout": settings.header_read_timeout})
