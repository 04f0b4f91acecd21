"""The real-server tests read the router's logs while workers write them: a line the kernel is
still copying in (no newline yet) is left for the next read, not parsed half-written. CI once
failed ``test_eight_prefixes...`` on ``unexpected end of data`` at exactly such a line."""

from __future__ import annotations

from pathlib import Path

from tests.real_gunicorn.support import complete_lines


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    log.write_bytes(b'{"request_id":"a"}\n{"request_id":"b"}\n{"request_id":"c","sta')
    assert complete_lines(str(log)) == [{"request_id": "a"}, {"request_id": "b"}]
    with log.open("ab") as f:
        f.write(b'tus":200}\n')
    assert complete_lines(str(log))[-1] == {"request_id": "c", "status": 200}


def test_an_empty_log_has_no_lines(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    log.write_bytes(b"")
    assert complete_lines(str(log)) == []
