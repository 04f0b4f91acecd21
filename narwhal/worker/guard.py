"""Every route's errors in the endpoint's shape, by the route's own handler rather than a middleware.

Invariant: whatever refuses a request (the router, aiohttp's 404/405/413, the header limit's 431,
an unhandled exception's 500) answers in the endpoint's error shape (OpenAI's, Anthropic's on
``/v1/messages``; docs/behaviour.md "The other P/D endpoints") with ``x-narwhal-error`` and an ``x-request-id``, never
a traceback.

Why not an aiohttp middleware: aiohttp runs middlewares for the whole application, and an app with
one also gets aiohttp's own ``_fix_request_current_app`` frame on every request: Python calls
beside the middleware's own, and one more coroutine frame to resume on every wakeup of a
request's task. So each route's handler is wrapped
(:meth:`Guard.wrap`, :meth:`Guard.route` for the P/D and passthrough endpoints, which call the
router in the same frame), and a resource matching every path, registered last
(:meth:`Guard.refuse_unrouted`), answers what no route takes: aiohttp's own 404/405, in shape.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web

from narwhal.engines.endpoints import Endpoint
from narwhal.errors import RequestError
from narwhal.reasons import Reason
from narwhal.request import client_failures
from narwhal.request.ids import client_request_id
from narwhal.request.router import Router

log = logging.getLogger("narwhal.worker.app")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]



class Served(Protocol):
    """Where the worker's router is once the startup hook built it (``None`` before)."""

    router: Router | None


def _check_header_size(request: web.Request, limit: int) -> None:
    raw = request.raw_headers  # each line is "name: value\r\n": 4 bytes beside the two
    size = len(request.raw_path) + 4 * len(raw) + sum(map(len, itertools.chain.from_iterable(raw)))
    if size > limit:
        raise RequestError(f"request headers exceed {limit} bytes", reason=Reason.HEADER_TOO_LARGE)


class Guard:
    """The error shaping of one app, with its header limit bound once, not read per request."""

    __slots__ = ("max_header_bytes",)

    def __init__(self, max_header_bytes: int) -> None:
        self.max_header_bytes = max_header_bytes

    def wrap(self, handler: Handler) -> Handler:
        """``handler`` with every error it raises (and the header limit) answered in shape."""
        limit = self.max_header_bytes

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                _check_header_size(request, limit)
                response = await handler(request)
            except (asyncio.CancelledError, ConnectionError):
                raise
            except Exception as exc:
                return client_failures.refusal(request, exc)
            if "x-request-id" not in response.headers and not response.prepared:
                response.headers["x-request-id"] = client_request_id(request)
            return response

        return guarded

    def route(self, endpoint: Endpoint, served: Served) -> Handler:
        """The handler of one registered endpoint (``narwhal.engines.endpoints``), P/D or
        passthrough alike, the endpoint resolved here once. ``call`` returns the router's
        coroutine without awaiting it: :meth:`wrap`'s frame awaits it, so a request's task
        resumes through no frame of its own on every wakeup (one plain call per request)."""

        def call(request: web.Request) -> Awaitable[web.StreamResponse]:
            router = served.router
            assert router is not None  # routes run only after the startup hooks
            return router.handle(request, endpoint)

        return self.wrap(call)

    def refuse_unrouted(self, app: web.Application) -> None:
        """After every route: what none of them takes is aiohttp's 404 or 405, in shape. A route
        of every method on every path (aiohttp's public dynamic resource), registered last: the
        dispatcher reaches it only when no earlier resource took both the path and the method."""
        everything = app.router.add_resource("/{unrouted:.*}")

        async def unrouted(request: web.Request) -> web.StreamResponse:
            allowed: set[str] = set()  # the methods other resources take on this path, as aiohttp finds them
            for resource in app.router.resources():
                if resource is not everything:
                    allowed |= (await resource.resolve(request))[1]
            if allowed:
                raise web.HTTPMethodNotAllowed(request.method, allowed)
            raise web.HTTPNotFound()

        everything.add_route("*", self.wrap(unrouted))
