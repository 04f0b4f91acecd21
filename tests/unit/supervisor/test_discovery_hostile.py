"""Whatever a discovery file holds, it is accepted or refused as a whole, and what is accepted
fits everything downstream (docs/behaviour.md, "Engines that come and go"): a lone surrogate,
a NUL, deep nesting, huge numbers, wrong types. Generated files, as the hostile-engine test does
for engines; the same through real gunicorn in tests/real_gunicorn/processes/test_discovery.py.

A FIFO is refused at once, and a read that hangs (a hung mount) is bounded: unreadable this
time, no second thread while it hangs.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal.shm import descriptors
from narwhal.supervisor.discovery import sources
from narwhal.supervisor.discovery.sources import FileReader, SourceInvalid, SourceUnreadable, read_engines_file

KEYS = ["name", "url", "role", "wave", "models", "kv_peers", "kv_connector", "max_inflight_prefill",
        "transfer_mode", "other"]
HOSTILE_TEXT = st.sampled_from(["m\ud800", "a\x00b", "\udfff", "x\n", "\x1b[31m", "ok", "é", "p0"])
SCALARS = st.one_of(HOSTILE_TEXT, st.integers(min_value=-(10**30), max_value=10**30), st.floats(allow_nan=True),
                    st.booleans(), st.none())
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(HOSTILE_TEXT, inner,
                                                                                          max_size=3), max_leaves=8)


def _entry(overrides: dict[str, Any]) -> dict[str, Any]:
    return {"name": "d1", "url": "http://127.0.0.1:9001", "role": "consumer", **overrides}


def _judge(path: Path) -> None:
    """Accepted, and every entry encodes for shared memory; or refused as a source error."""
    try:
        specs = read_engines_file(str(path))
    except (SourceInvalid, SourceUnreadable) as exc:
        assert "\n" not in str(exc) or "does not parse" in str(exc)
        return
    for spec in specs:
        descriptors.encode(spec.model_dump(), "file")  # raises on anything that cannot be written


@settings(max_examples=300, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))
def test_a_generated_hostile_entry_is_accepted_whole_or_refused(tmp_path: Path, overrides: dict[str, Any]) -> None:
    path = tmp_path / "engines.json"
    path.write_bytes(json.dumps({"engines": [_entry(overrides)]}).encode())  # \ud800 stays an escape
    _judge(path)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:0", "http://:9001", "http://h:x"])
def test_an_engine_url_with_a_bad_port_or_host_is_refused_naming_the_entry(tmp_path: Path, url: str) -> None:
    """Once accepted, such a URL kept a discovered engine probing forever, or an admitted one's
    load reader logging a traceback every read."""
    path = tmp_path / "engines.json"
    path.write_text(json.dumps({"engines": [_entry({"url": url})]}))
    with pytest.raises(SourceInvalid) as refused:
        read_engines_file(str(path))
    assert "engines.0.url: expected an http:// or https:// URL with a host and a port 1-65535" in str(refused.value)


@pytest.mark.parametrize("text", [
    '{"engines": [{"name": "d1", "url": "http://127.0.0.1:9001", "role": "consumer", "models": ["m\\ud800"]}]}',
    '{"engines": [{"name": "d1", "url": "http://127.0.0.1:9001", "role": "consumer", "wave": "a\\u0000b"}]}',
    '{"engines": ' + "[" * 100000 + "]" * 100000 + "}",
    '{"engines": [{"name": "d1", "url": "http://127.0.0.1:9001", "role": "consumer", "max_inflight_decode": 1e999}]}',
    '{"engines": [{"name": "d1", "url": "http://127.0.0.1:9001", "role": "consumer", "max_inflight_decode": '
    + "9" * 5000 + "}]}",
])
def test_the_known_hostile_files_are_refused_with_the_entry_and_key(tmp_path: Path, text: str) -> None:
    path = tmp_path / "engines.json"
    path.write_text(text)
    with pytest.raises((SourceInvalid, SourceUnreadable)) as refused:
        read_engines_file(str(path))
    if "ud800" in text:
        assert "engines.0.models.0: Input should be a valid string" in str(refused.value)  # the entry and key


async def test_a_read_that_hangs_is_bounded_and_starts_no_second_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    started: list[str] = []

    def hung_mount(path: str) -> list[Any]:  # as a read on a hung network mount: blocks until it recovers
        started.append(path)
        release.wait(10)
        return []

    monkeypatch.setattr(sources, "read_engines_file", hung_mount)
    reader = FileReader(str(tmp_path / "engines.toml"), 0.2)
    for _ in range(3):
        with pytest.raises(SourceUnreadable, match="has not finished after 0.2s"):
            await reader.read()
    assert len(started) == 1  # one thread stuck, not three
    release.set()  # the mount recovers: the stuck read finishes, and the reads go on
    assert await asyncio.wait_for(reader.read(), 5) == []
    assert await asyncio.wait_for(reader.read(), 5) == [] and len(started) == 2


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "engines.toml"
    os.mkfifo(fifo)
    with pytest.raises(SourceInvalid, match="not a regular file"):
        read_engines_file(str(fifo))
