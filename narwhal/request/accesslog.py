"""One JSON line per finished request (docs/operations.md "Following a request"), whatever the log level.

Lines are orjson-encoded and buffered per worker, then written at most ``FLUSH_S`` after the
request ended (or as soon as ``PIPE_BUF`` bytes wait): a write syscall per request was a
measurable share of the router's CPU (the perf suite's ``accesslog_c32`` scenario). Every
``os.write`` holds whole lines and at most ``PIPE_BUF`` bytes (or one longer line), so lines
from several workers never interleave, not even on a pipe (stderr under systemd); the file is
opened ``O_APPEND``. The buffer is flushed when the worker stops; a ``kill -9`` loses at most
the last ``FLUSH_S`` of lines. No ``logging`` machinery on this path. Prompts and completions
are never part of the line.
"""

from __future__ import annotations

import asyncio
import os
import select
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from narwhal.fleet.placement.policy import Placed


@dataclass(slots=True)
class AccessRecord:
    """What one request's access-log line says, filled in as it goes; written once, when it ends."""

    request_id: str
    endpoint: str
    model: str | None = None
    status: int = 0
    producer: str | None = None
    consumer: str | None = None
    attempts: int = 0
    migrations: int = 0  # continuations of the stream after a cut (docs/behaviour.md "Migration")
    ttft_s: float | None = None
    first_byte_s: float | None = None
    total_s: float | None = None
    reason: str | None = None
    stream: bool | None = None
    # "disaggregated", "same_worker", "local" (docs/behaviour.md "Placement"), "passthrough" (one engine, no P/D);
    # None: never placed
    mode: str | None = None
    prompt_tokens: int | None = None  # of the prefill, as the producer reported them
    cached_tokens: int | None = None
    client: str | None = None  # the peer address (X-Forwarded-For is not trusted: see README)
    backend_ids: list[str] = field(default_factory=list)  # the X-Request-Id of each attempt, in order
    completion_tokens: int | None = None  # the decode's, when the engine reported usage
    # The placement policy's note of the reservation (policy.Placed): its predicted cached
    # characters and tokens are the line's; None: the policy keeps none.
    placed: Placed | None = None
    # The request's trace: its server span's with tracing on, else the client's traceparent's (the
    # trace the engines' spans join); None without tracing and without a valid traceparent.
    trace_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The line's JSON fields in their documented order (docs/operations.md "Following a
        request"), stamped with the wall clock now.
        """
        placed = self.placed
        return {
            "ts": round(time.time(), 6),
            "request_id": self.request_id,
            "model": self.model,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "status": self.status,
            "producer": self.producer,
            "consumer": self.consumer,
            "attempts": self.attempts,
            "migrations": self.migrations,
            "ttft_s": _round(self.ttft_s),
            "first_byte_s": _round(self.first_byte_s),
            "total_s": _round(self.total_s),
            "reason": self.reason,
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "client": self.client,
            "backend_ids": self.backend_ids,
            "completion_tokens": self.completion_tokens,
            "predicted_cached_chars": None if placed is None else placed.predicted_cached_chars,
            "predicted_cached_tokens": None if placed is None else placed.predicted_cached_tokens,
            "trace_id": self.trace_id,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


FLUSH_S = 0.1
PIPE_BUF = select.PIPE_BUF  # the largest write a pipe keeps whole (4096 on Linux)


class AccessLog:
    """A worker's buffered access-log writer: ``""`` logs nothing, ``"-"`` is stderr, else a file."""

    def __init__(self, target: str) -> None:
        self._fd: int | None
        self._owned = False
        self._lines: list[bytes] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        if target == "":
            self._fd = None
        elif target == "-":
            self._fd = sys.stderr.fileno()
        else:
            self._fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._owned = True

    def write(self, record: AccessRecord) -> None:
        """Queue the line, written within ``FLUSH_S`` (at once past ``PIPE_BUF`` or with no loop); once a request."""
        if self._fd is None:
            return
        line = orjson.dumps(record.as_dict()) + b"\n"
        self._lines.append(line)
        self._size += len(line)
        if self._size >= PIPE_BUF:
            self.flush()
        elif self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
            except RuntimeError:  # no event loop (a synchronous caller): write now
                self.flush()

    def flush(self) -> None:
        """Write every queued line now, whole lines per ``PIPE_BUF`` write; a write error is dropped."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        lines, self._lines, self._size = self._lines, [], 0
        if self._fd is None or not lines:
            return
        batch: list[bytes] = []
        size = 0
        for line in lines:
            if batch and size + len(line) > PIPE_BUF:
                self._write(b"".join(batch))
                batch, size = [], 0
            batch.append(line)
            size += len(line)
        self._write(b"".join(batch))

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        try:
            os.write(self._fd, data)
        except OSError:
            pass  # a full disk must not fail requests that were already answered

    def close(self) -> None:
        """Flush, then close a file this log opened (never stderr); later writes are dropped."""
        self.flush()
        if self._owned and self._fd is not None:
            os.close(self._fd)
        self._fd = None
