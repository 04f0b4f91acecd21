"""Request ids: the client's ``x-request-id`` when usable, else a new one; backend ids per attempt.

A client's id is used only when it is printable ASCII of at most ``_MAX_REQUEST_ID`` characters
(docs/behaviour.md "The request path"); anything else is replaced by a new id, never refused: the id
is echoed in a response header and logged, and only ASCII survives every hop unchanged (aiohttp
decodes header bytes as UTF-8, with undecodable bytes as surrogates that no encoder accepts).

A backend id (the ``X-Request-Id`` both legs of an attempt send) is derived from the client's
id — ``<client id>-<nonce>-a<attempt>`` — so a grep for the client's id finds the router's
line and the engines' (vLLM takes ``X-Request-Id`` as its request id: ``cmpl-<id>`` in its
logs and answers). The client's part is cut to ``_MAX_CLIENT_PART`` characters of a safe
alphabet (it travels in headers, logs and JSON bodies); the nonce keeps the id unique when two
clients send the same id, since an engine refuses a request id that is already running.

Why not ``uuid4()``: a random per-process prefix and a counter give the same 32 hex digits far
cheaper on the per-request path; forked workers re-seed, so two workers never share a prefix.
"""

from __future__ import annotations

import itertools
import os
import re

from aiohttp import web

_MAX_REQUEST_ID = 128
_MAX_CLIENT_PART = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")

_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


def new_id() -> str:
    """A unique id (32 hex digits, like a uuid4's): a random per-process prefix and a counter,
    which is far cheaper than ``uuid4()`` on the per-request path. Forked workers re-seed."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def backend_id(client_id: str, attempt: int) -> str:
    """The backend request id of ``attempt`` (1, 2, ...) of the request ``client_id``: fresh per
    attempt, unique on the host, and greppable by the client's id."""
    part = _UNSAFE.sub("_", client_id[:_MAX_CLIENT_PART])
    return f"{part}-{_NONCE_PREFIX}{next(_NONCE_COUNTER) & 0xFFFFFFFF:08x}-a{attempt}"


def attempt_of(backend: str) -> int:
    """The attempt number a :func:`backend_id` ends with."""
    return int(backend.rsplit("-a", 1)[1])


_NONCE_PREFIX = os.urandom(4).hex()
_NONCE_COUNTER = itertools.count()


def _reseed_ids() -> None:
    global _ID_PREFIX, _ID_COUNTER, _NONCE_PREFIX, _NONCE_COUNTER
    _ID_PREFIX = os.urandom(8).hex()
    _ID_COUNTER = itertools.count()
    _NONCE_PREFIX = os.urandom(4).hex()
    _NONCE_COUNTER = itertools.count()


os.register_at_fork(after_in_child=_reseed_ids)


def printable_ascii(value: str) -> bool:
    """``value`` is printable ASCII (space to ``~``): what a header may carry to an engine, a
    client and a log unchanged."""
    return value.isascii() and value.isprintable()


def client_request_id(request: web.Request) -> str:
    """The request's id: the client's ``x-request-id`` if safe to echo and log, else a new one."""
    given = request.headers.get("x-request-id")
    if given and len(given) <= _MAX_REQUEST_ID and printable_ascii(given):
        return given
    return new_id()


# W3C Trace Context: version, trace id, parent id, flags (a later version may append fields).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?")
_NO_TRACE = "0" * 32


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a valid ``traceparent`` header, else None (the access log's ``trace_id``
    with tracing off: the trace the engines' own spans join, since the header reaches them
    unchanged)."""
    if traceparent is None or (m := _TRACEPARENT.fullmatch(traceparent)) is None:
        return None
    version, trace_id, parent, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == _NO_TRACE or parent == "0" * 16:
        return None
    return trace_id
