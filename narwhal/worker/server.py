"""aiohttp's server, answering its own protocol-level refusals in the OpenAI error shape.

aiohttp's HTTP parser refuses some requests before any handler runs (a header line over the
limit, too many headers, a duplicated singleton header, a malformed request line) and answers
them in plain text, echoing the offending bytes and logging a traceback. Narwhal's contract is
one error shape everywhere and never an echo of client bytes, so ``handle_error`` is replaced
on the connection handler. ``make_runner`` wires it in: the one place that knows about it.
Under gunicorn the runner also accepts the connections itself (``narwhal.worker.accept``).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from narwhal.errors import NarwhalError
from narwhal.reasons import Reason
from narwhal.request.client_failures import error_response
from narwhal.worker.accept import BalancedSite, ConnectionShare

log = logging.getLogger("narwhal.worker.server")


class _Handler(RequestHandler):
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started: cannot send an error")
        if status >= 500:
            log.error("unhandled error in the HTTP server", exc_info=exc)
            reason, status, text = Reason.INTERNAL_ERROR, 500, "internal error"
        elif isinstance(exc, LineTooLong) or "Too many headers" in str(exc or message or ""):
            reason, status, text = Reason.HEADER_TOO_LARGE, 431, "request headers too large"
        elif status == 413:
            reason, text = Reason.PAYLOAD_TOO_LARGE, "request body too large"
        else:
            reason, status, text = Reason.BAD_REQUEST, 400, "malformed HTTP request"
        log.debug("refused a malformed request: %s", exc)
        # The request's bytes are what was refused: no header of it is trusted, so no id is echoed.
        resp = error_response(NarwhalError(text, reason=reason, status=status), None)
        resp.force_close()
        return resp


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class NarwhalRunner(web.AppRunner):
    """The app's runner; with ``listeners`` (gunicorn's sockets) it also starts one
    :class:`narwhal.worker.accept.BalancedSite` per socket once the app is up."""

    def __init__(
        self,
        app: web.Application,
        *,
        listeners: Sequence[socket.socket] = (),
        share: Callable[[], ConnectionShare | None] = lambda: None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._listeners = list(listeners)
        self._share = share

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Same object, one overridden factory method: no private constructor to replicate.
        server.__class__ = _Server
        return server

    async def setup(self) -> None:
        """aiohttp's set-up, then a :class:`BalancedSite` per listener."""
        await super().setup()
        share = self._share()
        for sock in self._listeners:
            await BalancedSite(self, sock, share).start()


def make_app_runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """The runner every worker app is served by (``NarwhalRunner``)."""
    return NarwhalRunner(app, **kwargs)
