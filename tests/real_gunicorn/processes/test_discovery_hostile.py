"""No discovery file stops the supervisor (docs/behaviour.md, "Engines that come and go"),
through real gunicorn: hostile files written in turn (a lone surrogate escape, a NUL, deep
nesting, a huge number, wrong types, a FIFO) are each refused as a whole with one line naming
the entry and key, the last good set stands, and the supervisor keeps its pid throughout.
Before the fix, the lone surrogate passed validation and raised in the descriptor's encoder: the
supervisor exited, and its replacement read the same file, every few seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from narwhal.testing.harness import FakeFleet, router_roles
from tests.real_gunicorn.processes.test_discovery import discovering_router, entry, names, served_by, wait_listed
from tests.real_gunicorn.support import wait_until

pytestmark = pytest.mark.timeout(120)

GOOD = '{"name": "p1", "url": "%s", "role": "producer"}'
HOSTILE = [
    ('{"engines": [%s, {"name": "d1", "url": "%s", "role": "consumer", "models": ["m\\ud800"]}]}',
     "engines.1.models.0: Input should be a valid string"),
    ('{"engines": [%s, {"name": "d1", "url": "%s", "role": "consumer", "wave": "a\\u0000b"}]}',
     "engines.1.wave: expected text without control characters"),
    ('{"engines": [%s, {"name": "d1", "url": "%s", "role": "consumer", "max_inflight_decode": 1e999}]}',
     "engines.1.max_inflight_decode:"),
    ('{"engines": [%s, {"name": "d1", "url": "%s", "role": ["consumer"]}]}', "engines.1.role:"),
    ('{"engines": [%s, {"name": "d1", "url": "%s", "role": "consumer", "models": {"a": 1}}]}', "engines.1.models:"),
]


def _supervisor(master: int) -> list[int]:
    return router_roles(master)["supervisor"]


async def test_hostile_files_are_refused_and_the_supervisor_keeps_its_pid(fleet: FakeFleet, tmp_path: Path) -> None:
    engines_file = tmp_path / "engines.json"
    good = '{"engines": [' + GOOD % fleet.engines["p1"] + "]}"
    engines_file.write_text(good)
    router = discovering_router(fleet, tmp_path, engines_file)
    try:
        await wait_listed(router, "p1", "admitted")
        supervisor = _supervisor(router.proc.pid)
        assert len(supervisor) == 1, supervisor
        d1 = entry(fleet, "d1", "consumer")["url"]
        for template, said in HOSTILE:
            _replace(engines_file, template % (GOOD % fleet.engines["p1"], d1))
            wait_until(lambda said=said: f"discovery: file refused, keeping its last good set (1 engines): "
                       f"{engines_file}: {said}" in router.log_text(), 10, f"the refusal naming {said!r}")
        _replace(engines_file, '{"engines": ' + "[" * 50000 + "]" * 50000 + "}")
        wait_until(lambda: "nested too deeply" in router.log_text(), 10, "the deep nesting's refusal")
        engines_file.unlink()
        os.mkfifo(engines_file)  # nobody ever writes it
        wait_until(lambda: f"{engines_file}: not a regular file" in router.log_text(), 10, "the FIFO's refusal")
        assert _supervisor(router.proc.pid) == supervisor  # never restarted
        assert "supervisor exited" not in router.log_text() and "Traceback" not in router.log_text()
        assert (await names(router)) == {"p0": "admitted", "d0": "admitted", "p1": "admitted"}
        engines_file.unlink()
        _replace(engines_file, '{"engines": [' + GOOD % fleet.engines["p1"] + ', {"name": "d1", "url": "'
                 + d1 + '", "role": "consumer"}]}')
        await wait_listed(router, "d1", "admitted")  # discovery goes on after all of it
        await served_by(router, fleet, "p1")
    finally:
        router.stop()


def _replace(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
