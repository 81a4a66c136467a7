"""uvicorn's HTTP/1.1 connection with a time limit on a request's headers.

uvicorn limits the idle time between requests and the app limits a body's time (server.py),
but nothing limits the headers: a client sending a byte every few seconds holds a connection
open for as long as it likes. Here a timer starts when a connection opens (and when the first
byte of a later request on it arrives) and stops once h11 has parsed the request's headers; if
it fires first, the client gets 408 in OpenAI's error shape and the connection closes."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError


def header_limited(header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class to pass as uvicorn.Config's `http` (ServerConfig.header_timeout_s)."""
    error = APIError(408, f"the request's headers did not arrive within {header_timeout_s:g} s",
                     code="timeout")
    body = json.dumps(error.payload()).encode()
    answer = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
              b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    class HeaderLimited(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer = self.loop.call_later(header_timeout_s, self.headers_too_slow)

        def data_received(self, data: bytes) -> None:
            if self.header_timer is None and self.conn.their_state is h11.IDLE:
                self.header_timer = self.loop.call_later(header_timeout_s, self.headers_too_slow)
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self.stop_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_header_timer()
            super().connection_lost(exc)

        def stop_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def headers_too_slow(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(answer)  # h11 sends no response before a request: raw bytes
                self.transport.close()

    return HeaderLimited

