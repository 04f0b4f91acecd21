"""Asking a router or an engine something over HTTP from a test, the demo or perf.

Each helper answers and never raises for what the server says or for a server that is not there
yet (``(0, b"")``, False, an unchanged set): they are the conditions the harness's bounded waits
poll. Why a module apart from the harness: starting and stopping processes is one concept, asking
them over the wire another, and a test that only asks needs only this one.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping


def http_get(url: str, timeout: float = 2.0, headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    """``(status, body)`` of a GET; ``(0, b"")`` when nothing answered, never raises for HTTP errors."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})), timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def http_ok(url: str) -> bool:
    """Did a GET of ``url`` answer 200?"""
    return http_get(url)[0] == 200


def worker_answered(url: str, seen: set[int]) -> int:
    """Ask ``/health`` once on a new connection; add the worker that answered to ``seen``."""
    status, body = http_get(url + "/health")
    if status == 200:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            seen.add(int(json.loads(body)["worker"]))
    return len(seen)


def worker_ready(url: str, ready: set[int]) -> int:
    """On one new connection, ask ``/health`` (which worker is this?) then ``/ready``; add a worker
    that answered ready to ``ready``. Every worker is asked because each learns the engines'
    models on its own: one worker's ``/ready`` says nothing of its siblings."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        health = conn.getresponse()
        worker = int(json.loads(health.read())["worker"])
        conn.request("GET", "/ready")
        answer = conn.getresponse()
        answer.read()
        if health.status == 200 and answer.status == 200:
            ready.add(worker)
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
        pass
    finally:
        conn.close()
    return len(ready)
