"""When the watchdog takes its supervisor for wedged (narwhal.supervisor.process.Watchdog)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

from narwhal.supervisor.process import STALE_S, STARTUP_S, Watchdog


@dataclass
class _Beats:
    supervisor_pid: int
    heartbeat_age_s: float


def _watchdog(beats: _Beats, child: int, started_ago_s: float) -> Watchdog:
    dog = Watchdog(cast(Any, beats), master=1)
    dog.child = child
    dog.started_at = time.monotonic() - started_ago_s
    return dog


def test_a_starting_supervisor_is_judged_by_its_own_first_beat_not_its_predecessors() -> None:
    # The last beat is the killed predecessor's (pid 10), long stale: the new one (pid 11) is
    # still importing and restoring state on a loaded host, and must be left to start.
    assert not _watchdog(_Beats(10, 60.0), child=11, started_ago_s=STALE_S * 3)._wedged()
    assert _watchdog(_Beats(10, 60.0), child=11, started_ago_s=STARTUP_S + 1)._wedged()


def test_a_supervisor_that_beat_and_stopped_is_wedged_after_stale_s() -> None:
    assert not _watchdog(_Beats(11, STALE_S / 2), child=11, started_ago_s=60)._wedged()
    assert _watchdog(_Beats(11, STALE_S + 0.5), child=11, started_ago_s=60)._wedged()
