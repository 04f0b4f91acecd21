"""Reading one answer as the load generator's client sees it: ok or why not, time to first
byte, tokens.

Why so little work per chunk: on a 2-core host the load generator competes with the router and
the engines for the same CPUs. Events are parsed (orjson) only until the first generated token
is found (what time-to-first-byte needs) and afterwards only counted. An answer that is not a
clean one is an :class:`Outcome` with an ``error`` key, never an exception: a failed run says
why (``error_key``), not only how many.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp
import orjson

from perf.load import pd_endpoints

DONE = b"data: [DONE]"


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it: ok or why not (``error``), seconds to first byte and in all, tokens."""

    ok: bool
    ttfb: float = 0.0
    total: float = 0.0
    tokens: int = 0
    error: str = ""


def _is_token(event: bytes) -> bool:
    """Does this SSE event carry generated output (docs/behaviour.md "Failure semantics": text, content, finish_reason
    …)?
    """
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return False
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False
        choices = obj.get("choices") if isinstance(obj, dict) else None
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            if choice.get("text") or choice.get("finish_reason") is not None:
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
                return True
    return False


async def read_stream(resp: aiohttp.ClientResponse, start: float) -> Outcome:
    """A streamed answer to its end: the first output event's time, the events after it counted."""
    carry = b""
    ttfb = 0.0
    tokens = 0
    done = False
    content = resp.content
    while chunk := await content.readany():
        data = carry + chunk if carry else chunk
        events = data.split(b"\n\n")
        carry = events.pop()
        for event in events:
            if not event:
                continue
            if event.startswith((DONE, *pd_endpoints.TERMINALS)):
                done = True
            elif b'"error"' in event:
                return Outcome(False, error="stream_error")
            elif tokens:
                tokens += 1  # after the first token every event is counted, not parsed
            elif _is_token(event) or pd_endpoints.is_output(event):
                ttfb = time.perf_counter() - start
                tokens = 1
    if not done:
        return Outcome(False, error="incomplete_stream")
    if not tokens:
        return Outcome(False, error="no_token")
    return Outcome(True, ttfb=ttfb, tokens=tokens)


async def read_body(resp: aiohttp.ClientResponse, start: float) -> Outcome:
    """A whole (non-streamed) answer: its first byte's time, the tokens its usage reports."""
    content = resp.content
    first = await content.readany()
    ttfb = time.perf_counter() - start
    parts = [first]
    while chunk := await content.readany():
        parts.append(chunk)
    try:
        obj = orjson.loads(b"".join(parts))
        tokens = int(obj["usage"]["completion_tokens"])
        if not obj.get("choices"):
            raise KeyError("choices")
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return Outcome(False, error="bad_body")
    return Outcome(True, ttfb=ttfb, tokens=tokens)


def error_key(status: int, body: bytes) -> str:
    """How a refusal is counted: its status and, when the body is an OpenAI-shaped error with a
    code, that code (``503:no_engine``): a failed run then says why, not only how."""
    try:
        error = orjson.loads(body).get("error")
        code = (error.get("code") or error.get("type")) if isinstance(error, dict) else None
    except (orjson.JSONDecodeError, AttributeError):
        code = None
    return f"{status}:{code}" if isinstance(code, str) and code else str(status)
