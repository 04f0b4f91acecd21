"""One JSON line per finished request (SPEC §8), whatever the log level.

Written with a single ``os.write`` of an orjson-encoded line to a file opened with
``O_APPEND``: every worker appends to the same file, and a write this small lands whole.
No ``logging`` machinery on this path: it is per request. Prompts and completions are
never part of the line.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(slots=True)
class AccessRecord:
    request_id: str
    endpoint: str
    model: str | None = None
    status: int = 0
    producer: str | None = None
    consumer: str | None = None
    attempts: int = 0
    ttft_s: float | None = None
    first_byte_s: float | None = None
    total_s: float | None = None
    reason: str | None = None
    stream: bool | None = None

    def as_dict(self) -> dict[str, Any]:
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
            "ttft_s": _round(self.ttft_s),
            "first_byte_s": _round(self.first_byte_s),
            "total_s": _round(self.total_s),
            "reason": self.reason,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class AccessLog:
    def __init__(self, target: str) -> None:
        self._fd: int | None
        self._owned = False
        if target == "":
            self._fd = None
        elif target == "-":
            self._fd = sys.stderr.fileno()
        else:
            self._fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._owned = True

    def write(self, record: AccessRecord) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, orjson.dumps(record.as_dict()) + b"\n")
        except OSError:
            pass  # a full disk must not fail the request that was already answered

    def close(self) -> None:
        if self._owned and self._fd is not None:
            os.close(self._fd)
        self._fd = None
