"""What the client sees of every failure, decided in one place (docs/behaviour.md "The other P/D endpoints", "Failure
semantics").

The engine side has one mapping of what the wire reports to reasons
(``narwhal.engines.failures``); this module is its client-side twin: it turns whatever ended a
client's request into what that client is sent, and what the access log and metrics say of it:

- a :class:`~narwhal.errors.NarwhalError` before the 200 went out: its status and body in the
  endpoint's error shape (OpenAI's; Anthropic's on ``/v1/messages``), ``x-narwhal-error`` and
  the client's ``x-request-id`` (:func:`error_response`, :func:`fail`);
- the same error after the 200: one terminal error event in the endpoint's shape, no
  ``[DONE]`` after it, and ``narwhal_stream_aborted_total`` (:func:`fail`);
- the client gone (its connection lost, or the handler cancelled): 499 in the access log and
  metrics only, nothing sent (:func:`client_gone`);
- the router shutting down while a request still runs: the ``shutting_down`` error (:data:`SHUTTING_DOWN`);
- what refused a request before the router saw it (aiohttp's 404/405/413, the header limit's
  431) or an unhandled exception's 500, never a traceback (:func:`refusal`, for ``worker.guard``).

Invariant: nothing else builds a client's error answer or terminal error event; the router, the
guard and the passthrough raise, and the answer is made here.
"""

from __future__ import annotations

import contextlib
import logging

from aiohttp import web

from narwhal import metrics
from narwhal.engines import dialects
from narwhal.engines.endpoints import BY_PATH
from narwhal.errors import NarwhalError, RequestError
from narwhal.reasons import Reason
from narwhal.request.accesslog import AccessRecord
from narwhal.request.client_stream import ClientStream
from narwhal.request.ids import client_request_id

log = logging.getLogger("narwhal.worker.app")

CLIENT_CLOSED = 499
"""nginx's "client closed request": the status a request the client left is counted with."""

HTTP_REASONS = {404: Reason.NOT_FOUND, 405: Reason.METHOD_NOT_ALLOWED, 413: Reason.PAYLOAD_TOO_LARGE}
"""aiohttp's own refusals (no route, wrong method, body too large) as the router's reasons."""


def shutting_down() -> NarwhalError:
    """The error a request still running when the graceful time ran out ends with."""
    return NarwhalError("the router is shutting down", reason=Reason.SHUTTING_DOWN)


def error_response(exc: NarwhalError, request_id: str | None, dialect: dialects.Dialect | None = None) -> web.Response:
    """The router's own error before the 200, in the endpoint's shape (OpenAI's by default);
    ``request_id`` None: a request whose bytes the HTTP parser refused, which has none."""
    headers = exc.headers()
    if request_id is not None:
        headers["x-request-id"] = request_id
    body = (dialect or dialects.DEFAULT_ERRORS).error_body(exc)
    return web.Response(status=exc.status, body=body, content_type="application/json", headers=headers)


async def fail(client: ClientStream, rec: AccessRecord, exc: NarwhalError) -> web.StreamResponse:
    """``exc`` ended the request: an HTTP error before the 200, else one terminal error event."""
    rec.reason = exc.reason
    if not client.committed or client.stream is None:
        rec.status = exc.status
        return error_response(exc, client.request_id, client.dialect)
    # The 200 is already on the wire: end the stream with one terminal error event.
    rec.status = 200
    metrics.STREAM_ABORTED.labels(exc.reason).inc()
    with contextlib.suppress(ConnectionError):
        await client.fail(exc)
    return client.stream


def client_gone(client: ClientStream, rec: AccessRecord) -> web.StreamResponse:
    """The client left: counted (499, ``client_disconnect``), nothing sent; the response aiohttp
    is handed back, for a handler that was not cancelled."""
    rec.status, rec.reason = CLIENT_CLOSED, Reason.CLIENT_DISCONNECT
    metrics.CLIENT_DISCONNECTS.inc()
    if client.committed:
        metrics.STREAM_ABORTED.labels(Reason.CLIENT_DISCONNECT).inc()
    return client.stream if client.stream is not None else web.Response(status=CLIENT_CLOSED)


def _shape(request: web.Request) -> dialects.Dialect | None:
    """The endpoint's error shape, whatever refused the request: Anthropic's on /v1/messages
    (docs/behaviour.md "The other P/D endpoints"), OpenAI's everywhere else."""
    endpoint = BY_PATH.get(request.path)
    return None if endpoint is None else endpoint.dialect


def refusal(request: web.Request, exc: Exception) -> web.StreamResponse:
    """The answer to ``exc``, raised by a route (never a cancellation or a lost connection)."""
    if isinstance(exc, NarwhalError):
        return error_response(exc, client_request_id(request), _shape(request))
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        reason = HTTP_REASONS.get(exc.status, Reason.BAD_REQUEST)
        refused = RequestError(exc.reason if exc.status != 404 else "not found", reason=reason, status=exc.status)
        return error_response(refused, client_request_id(request), _shape(request))
    log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
    error = NarwhalError("internal error", reason=Reason.INTERNAL_ERROR)
    return error_response(error, client_request_id(request), _shape(request))
