"""The access log's buffering: lines land within FLUSH_S, whole, in writes no pipe splits."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import orjson
import pytest

from narwhal.request import accesslog
from narwhal.request.accesslog import PIPE_BUF, AccessLog, AccessRecord


def _lines(path: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def test_lines_are_written_within_the_flush_interval(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    log = AccessLog(str(path))
    for i in range(3):
        log.write(AccessRecord(request_id=f"r{i}", endpoint="/v1/completions", status=200))
    assert path.read_bytes() == b""  # buffered, not one syscall per request
    for _ in range(100):  # bounded wait: FLUSH_S is 0.1 s
        if len(_lines(path)) == 3:
            break
        await asyncio.sleep(accesslog.FLUSH_S / 4)
    assert [line["request_id"] for line in _lines(path)] == ["r0", "r1", "r2"]
    log.close()


async def test_every_write_is_whole_lines_and_at_most_pipe_buf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "access.log"
    log = AccessLog(str(path))
    writes: list[bytes] = []
    real_write = os.write

    def spy(fd: int, data: bytes) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(accesslog.os, "write", spy)
    for i in range(200):  # ~40 KiB of lines: flushed by size, several times
        log.write(AccessRecord(request_id=f"req-{i:04d}", endpoint="/v1/chat/completions", model="m" * 40))
    log.close()  # flushes the rest
    assert len(writes) > 1
    assert all(len(w) <= PIPE_BUF and w.endswith(b"\n") for w in writes)
    assert [line["request_id"] for line in _lines(path)] == [f"req-{i:04d}" for i in range(200)]


def test_without_a_loop_a_line_is_written_at_once(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    log = AccessLog(str(path))
    log.write(AccessRecord(request_id="sync", endpoint="/v1/completions"))
    assert [line["request_id"] for line in _lines(path)] == ["sync"]
    log.close()


def test_an_empty_target_writes_nothing(tmp_path: Path) -> None:
    log = AccessLog("")
    log.write(AccessRecord(request_id="x", endpoint="/v1/completions"))
    log.close()
    assert list(tmp_path.iterdir()) == []
