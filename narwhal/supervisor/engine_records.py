"""The breakers' statuses as shared-memory engine records, and back: pure conversions.

Invariant: a record says of its engine exactly what the breakers and the reachability say —
state, streak, ejections, quarantine and last failure (times on the wall clock, so another
process, and a supervisor started later, reads them), the operator's ejection, the wave's hold
and unreachability as flags — stamped with the engine's identity, so a record left at a slot
another engine has since taken is never read as that engine's.

Why apart from the edge (``supervisor.edge``): the edge decides when to publish and writes; what
a record holds is a question of its own, asked at every publish and at every restart, and
answered here without shared memory or a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from narwhal.fleet import Engine
from narwhal.shm.records import (
    RECORD_BY_OPERATOR,
    RECORD_KV_EVENTS,
    RECORD_UNREACHABLE,
    RECORD_WAITING_FOR_WAVE,
    EngineRecord,
)
from narwhal.shm.table import record_hash
from narwhal.supervisor.breaker import Breakers, EngineStatus, State
from narwhal.supervisor.reachability import Reachability


@dataclass(frozen=True, slots=True)
class Restored:
    """What a previous supervisor published for one engine, in the breakers' terms."""

    status: EngineStatus
    by_operator: bool
    waiting: bool
    unreachable: bool


def record(engine: Engine, breakers: Breakers, reach: Reachability, version: int, wall: float,
           events: bool = False) -> EngineRecord:
    """``engine``'s record under generation ``version`` (``wall``: the wall clock minus the
    monotonic one; ``events``: its holdings follow its KV-cache events)."""
    st = breakers.status(engine.name)
    return EngineRecord(
        version=version,
        state=int(st.state),
        failure_streak=st.failure_streak,
        ejections=st.ejections,
        quarantined_until=None if st.quarantined_until is None else st.quarantined_until + wall,
        last_failure_reason=st.last_failure_reason,
        last_failure_at=None if st.last_failure_at is None else st.last_failure_at + wall,
        name_hash=record_hash(engine.name, engine.url),
        flags=(RECORD_BY_OPERATOR if breakers.ejected_by_operator(engine.name) else 0)
        | (RECORD_WAITING_FOR_WAVE if breakers.waiting_for_wave(engine.name) else 0)
        | (RECORD_UNREACHABLE if reach.unreachable(engine.name) else 0)
        | (RECORD_KV_EVENTS if events else 0),
    )


def restored(engine: Engine, rec: EngineRecord | None, wall: float) -> Restored | None:
    """What ``rec`` says of ``engine`` (None: no record, or another engine's)."""
    if rec is None or rec.name_hash != record_hash(engine.name, engine.url):
        return None
    status = EngineStatus(
        name=engine.name,
        state=State(rec.state),
        failure_streak=rec.failure_streak,
        ejections=rec.ejections,
        quarantined_until=None if rec.quarantined_until is None else rec.quarantined_until - wall,
        last_failure_reason=rec.last_failure_reason,
        last_failure_at=None if rec.last_failure_at is None else rec.last_failure_at - wall,
    )
    return Restored(status, by_operator=bool(rec.flags & RECORD_BY_OPERATOR),
                    waiting=bool(rec.flags & RECORD_WAITING_FOR_WAVE),
                    unreachable=bool(rec.flags & RECORD_UNREACHABLE))
