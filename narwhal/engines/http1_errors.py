"""What an HTTP/1.1 exchange with an engine fails with: the error classes of ``engines.http1``.

Invariant: each names where the exchange stood when it failed, which is what a retry needs to
know — ``ConnectFailed``: nothing was sent; ``ConnectionLost``: the connection ended before the
whole response (``got_headers`` says whether its head had come); ``ProtocolError``: the bytes are
no HTTP/1.1 response; ``DeadlinePassed``: the exchange's own deadline closed it. Why a module of
their own: the pool (``http1``), the connection (``http1_connection``) and the SSE reader
(``sse``) raise them, and ``engines.failures`` maps them to the router's reasons, without any of
those importing the others for a class.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """A transport failure talking to an engine."""


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing was sent."""


class ConnectionLost(UpstreamError):
    """The connection ended before the whole response arrived."""

    def __init__(self, message: str, *, got_headers: bool) -> None:
        super().__init__(message)
        self.got_headers = got_headers


class ProtocolError(UpstreamError):
    """The engine sent bytes that are not a valid HTTP/1.1 response."""


class DeadlinePassed(TimeoutError):
    """The exchange's deadline (``post(..., deadline=)``) passed: the connection was closed."""
