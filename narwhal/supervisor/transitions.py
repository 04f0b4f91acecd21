"""One log line per breaker transition, per change of reachability, and per charge.

Why: an operator who sees traffic move from one engine to another must be able to read why in
the log: which engine, which state it entered, and the evidence. Before this, nothing said an
engine was ejected, quarantined, kept serving because ``max_ejected_fraction`` forbade its
ejection (``degraded``), or readmitted. Lines are written where the supervisor publishes, so a
line appears exactly when the workers are told; the previous state of each engine is the one
last published (a restarted supervisor starts from the records it took over, so a restart logs
no false transitions).

Every charge is a line too, naming the engine charged and the engine whose leg failed (a
producer can be charged for a decode that failed on a consumer: blame's rules), and is counted
in ``narwhal_engine_failures_total`` for the engine charged, so the metric always agrees with
the breaker.

Levels: leaving service (ejected, degraded, unreachable) is a warning; the rest is info.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from narwhal import metrics
from narwhal.fleet import Engine
from narwhal.settings import RecoverySettings
from narwhal.supervisor.breaker import Breakers, Charged, EngineStatus, State
from narwhal.supervisor.reachability import Reachability

log = logging.getLogger("narwhal.supervisor.breakers")
charges_log = logging.getLogger("narwhal.supervisor.charges")

_WARN = frozenset({State.EJECTED, State.DEGRADED})


def why(status: EngineStatus, breakers: Breakers, settings: RecoverySettings) -> str:
    """The evidence behind an engine's current state, in a few words: what moved it there (an
    operator, discovery, a probe, the end of a quarantine) or its streak; never "streak
    cleared" while a streak still counts."""
    last = status.last_failure_reason or "none"
    streak = f"{status.failure_streak} failure(s) in a row, last {last}"
    state, cause = status.state, breakers.cause(status.name)
    if state is State.EJECTED:
        if breakers.ejected_by_operator(status.name):
            return "by the operator"
        if breakers.waiting_for_wave(status.name):
            return "passed readmission, waiting for its wave"
        if cause is not None:
            return cause
        return f"{streak}; ejection {status.ejections}"
    if state is State.DEGRADED:
        return f"{streak}; not ejected: max_ejected_fraction {settings.max_ejected_fraction:g} reached"
    if state is State.QUARANTINED:
        return f"{streak}; quarantined for {settings.failure_quarantine_s:g}s"
    if state is State.PROBING:
        return "readmission probe under way"
    if state is State.DRAINING:
        return cause or "drained by the operator"
    if status.failure_streak:
        return f"{cause or 'back in service'}; {streak}"
    return cause or "streak cleared"


def log_transitions(engines: Iterable[Engine], breakers: Breakers, reach: Reachability,
                    states: dict[str, State], settings: RecoverySettings) -> None:
    """Log each engine whose state moved since the last call (``states`` is updated), then each
    change of reachability since then."""
    for engine in engines:
        status = breakers.status(engine.name)
        before = states.get(engine.name)
        states[engine.name] = status.state
        if before is None or before is status.state:
            continue
        level = logging.WARNING if status.state in _WARN else logging.INFO
        log.log(level, "engine %s (%s): %s -> %s: %s", engine.name, engine.role, before.name.lower(),
                status.state.name.lower(), why(status, breakers, settings))
    for name, reachable in reach.take_changes():
        if reachable:
            log.info("engine %s: reachable again", name)
        else:
            log.warning("engine %s: unreachable (its last connection attempt failed); placed last from now on",
                        name)


def log_charges(engines: Iterable[Engine], charged: list[Charged]) -> None:
    """One line per charge, and its count in ``narwhal_engine_failures_total`` for the engine charged."""
    roles = {engine.name: engine.role for engine in engines}
    for c in charged:
        metrics.ENGINE_FAILURES.labels(c.engine, c.phase, c.reason).inc()
        leg = "its own" if c.failed == c.engine else f"{c.failed}'s"
        charges_log.warning("engine %s (%s) charged as %s: %s %s leg failed: %s", c.engine,
                            roles.get(c.engine, "?"), c.role, leg, c.phase, c.reason)
