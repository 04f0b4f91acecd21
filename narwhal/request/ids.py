"""Request ids: the client's ``x-request-id`` when usable, else a new one; backend ids per attempt.

Why not ``uuid4()``: a random per-process prefix and a counter give the same 32 hex digits far
cheaper on the per-request path; forked workers re-seed, so two workers never share a prefix.
"""

from __future__ import annotations

import itertools
import os

from aiohttp import web

_MAX_REQUEST_ID = 128

_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


def new_id() -> str:
    """A unique id (32 hex digits, like a uuid4's): a random per-process prefix and a counter,
    which is far cheaper than ``uuid4()`` on the per-request path. Forked workers re-seed."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def _reseed_ids() -> None:
    global _ID_PREFIX, _ID_COUNTER
    _ID_PREFIX = os.urandom(8).hex()
    _ID_COUNTER = itertools.count()


os.register_at_fork(after_in_child=_reseed_ids)


def client_request_id(request: web.Request) -> str:
    given = request.headers.get("x-request-id")
    if given and len(given) <= _MAX_REQUEST_ID and given.isprintable():
        return given
    return new_id()
