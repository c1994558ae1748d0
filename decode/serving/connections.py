"""uvicorn's HTTP/1.1 connections with a deadline on a request's headers.

uvicorn closes an idle keep-alive connection, but a client that opens a connection and sends its headers a byte at a
time, or never finishes them, holds it for ever. Here the headers of each request must be complete within the
read timeout of the connection's start (or of the previous response's end), or the connection is closed. The body's
own deadline is the app's (a 408 answer).
"""
import asyncio
import functools

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadersDeadline(H11Protocol):
    """H11Protocol that closes a connection whose next request's headers take over `read_timeout` seconds."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.follow_headers()

    def handle_events(self) -> None:
        super().handle_events()
        self.follow_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.follow_headers()

    def connection_lost(self, exc) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        super().connection_lost(exc)

    def follow_headers(self) -> None:
        """A deadline while the client owes a request's headers (h11's IDLE state), none once they are in."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self.deadline is None:
            self.deadline = self.loop.call_later(self.read_timeout, self.timeout_keep_alive_handler)
        elif not waiting and self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None


def protocol(read_timeout: float):
    """The protocol class to pass uvicorn.Config as `http`."""
    return functools.partial(HeadersDeadline, read_timeout=read_timeout)
