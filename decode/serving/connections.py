"""uvicorn's HTTP/1.1 connections with a deadline on a request's headers, and a limit on their size.

uvicorn closes an idle keep-alive connection, but a client that opens a connection and sends its headers a byte at a
time, or never finishes them, holds it for ever. Here the headers of each request must be complete within the
read timeout of the connection's start (or of the previous response's end), or the connection is closed. The body's
own deadline is the app's (a 408 answer).

h11 limits a request line and headers to 16 KiB only while they are incomplete: a larger head that arrives whole, in
one read, passed. Here any head over MAX_HEAD is answered 431 and the connection closed.
"""
import asyncio
import functools

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEAD = 16 * 1024  # bytes of a request line and headers (h11's own limit on an incomplete head, as uvicorn sets it)
TOO_LARGE = b"The request line and headers exceed 16 KiB."
ANSWER_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(TOO_LARGE), TOO_LARGE))


class HeadersDeadline(H11Protocol):
    """H11Protocol that closes a connection whose next request's headers take over `read_timeout` seconds, and
    answers 431 to a request line and headers over MAX_HEAD bytes."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.deadline: asyncio.TimerHandle | None = None
        self.head = b""  # the next request's head received so far, while it is incomplete

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self.head_too_large(data):
            self.transport.write(ANSWER_TOO_LARGE)
            self.transport.close()
            return
        super().data_received(data)

    def head_too_large(self, data: bytes) -> bool:
        """Whether the head still arriving passes MAX_HEAD with `data`."""
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        size = len(self.head) if end < 0 else end
        if end >= 0:
            self.head = b""
        return size > MAX_HEAD

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
